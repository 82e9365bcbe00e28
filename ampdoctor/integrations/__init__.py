"""Thin adapters from training frameworks to :func:`ampdoctor.watch` (one file per framework).

* :mod:`ampdoctor.integrations.hf` — ``AmpDoctorCallback`` for ``transformers.Trainer`` (``pip install ampdoctor[hf]``)
* :mod:`ampdoctor.integrations.lightning` — ``AmpDoctorCallback`` for Lightning (``pip install ampdoctor[lightning]``)
* :mod:`ampdoctor.integrations.accelerate` — ``watch_accelerator`` (``pip install ampdoctor[accelerate]``)
* :mod:`ampdoctor.integrations.run` — ``run_script``, behind ``ampdoctor run -- python train.py ARGS``

Each module imports its framework when imported itself; this package imports none of them.
"""
