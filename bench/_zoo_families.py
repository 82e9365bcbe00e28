"""The architecture zoo: tiny model families built from configs (no downloads), each with a training batch.

A family is one registered builder (``@family(name, kind)``) returning a :class:`Built`: the model (dropout
off, train mode), a batch, and a ``loss_fn`` when the model does not return its own loss. Builders draw from
the global RNG; callers seed it. Registering a name twice raises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

V, B, T = 96, 2, 8  # vocab, batch, sequence length


@dataclass(frozen=True)
class Built:
    model: nn.Module
    batch: Any
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # decoder | encoder | encdec | vision | audio | diffusers
    build: Callable[[], Built]


FAMILIES: dict[str, Family] = {}


def family(name: str, kind: str) -> Callable[[Callable[[], Built]], Callable[[], Built]]:
    def deco(fn: Callable[[], Built]) -> Callable[[], Built]:
        if name in FAMILIES:
            raise ValueError(f"zoo family {name!r} is already registered")
        FAMILIES[name] = Family(name, kind, fn)
        return fn
    return deco


def _quiet(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model.train()


def _hf(model_cls: str, config_cls: str, **cfg: Any) -> nn.Module:
    import transformers

    config = getattr(transformers, config_cls)(**cfg)
    return _quiet(getattr(transformers, model_cls)(config))


_TXT = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, pad_token_id=0)
_DROP = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _ids(n: int = T) -> torch.Tensor:
    return torch.randint(3, V, (B, n))


def _causal(model_cls: str, config_cls: str, **cfg: Any) -> Built:
    ids = _ids()
    return Built(_hf(model_cls, config_cls, **cfg), {"input_ids": ids, "labels": ids.clone()})


def _mlm(model_cls: str, config_cls: str, **cfg: Any) -> Built:
    ids = _ids()
    return Built(_hf(model_cls, config_cls, **cfg), {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                                    "labels": ids.clone()})


def _s2s(model_cls: str, config_cls: str, **cfg: Any) -> Built:
    return Built(_hf(model_cls, config_cls, **cfg), {"input_ids": _ids(), "labels": _ids(6)})


_DEC = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(_TXT, num_key_value_heads=2)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(_TXT, num_key_value_heads=2)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(_TXT, num_key_value_heads=2)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(_TXT, num_key_value_heads=2, head_dim=8)),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(_TXT, num_key_value_heads=2, head_dim=8)),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(_TXT, num_key_value_heads=2, head_dim=8)),
    "phi": ("PhiForCausalLM", "PhiConfig", dict(_TXT, resid_pdrop=0.0, embd_pdrop=0.0)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(_TXT, num_key_value_heads=2)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "gpt_neo": ("GPTNeoForCausalLM", "GPTNeoConfig", dict(vocab_size=V, hidden_size=32, num_layers=2,
                                                          num_heads=4, attention_types=[[["global", "local"], 1]],
                                                          max_position_embeddings=64, window_size=4)),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(_TXT)),
    "gptj": ("GPTJForCausalLM", "GPTJConfig", dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                                   n_positions=64)),
    "opt": ("OPTForCausalLM", "OPTConfig", dict(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=32,
                                                max_position_embeddings=64, dropout=0.0)),
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(vocab_size=V, hidden_size=32, n_layer=2, n_head=4)),
    "falcon": ("FalconForCausalLM", "FalconConfig", dict(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                         num_attention_heads=4)),
    "mpt": ("MptForCausalLM", "MptConfig", dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=64)),
    "codegen": ("CodeGenForCausalLM", "CodeGenConfig", dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4,
                                                            rotary_dim=4, n_positions=64, n_ctx=64)),
    "gpt_bigcode": ("GPTBigCodeForCausalLM", "GPTBigCodeConfig", dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4,
                                                                     n_positions=64)),
    "starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", dict(_TXT, num_key_value_heads=2)),
    "olmo": ("OlmoForCausalLM", "OlmoConfig", dict(_TXT)),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", dict(_TXT, num_key_value_heads=2)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(_TXT, num_key_value_heads=2, num_local_experts=4,
                                                            num_experts_per_tok=2)),
    "granite": ("GraniteForCausalLM", "GraniteConfig", dict(_TXT, num_key_value_heads=2)),
    "cohere": ("CohereForCausalLM", "CohereConfig", dict(_TXT, num_key_value_heads=2)),
    "xglm": ("XGLMForCausalLM", "XGLMConfig", dict(vocab_size=V, d_model=32, num_layers=2, attention_heads=4,
                                                   ffn_dim=64, max_position_embeddings=64, dropout=0.0)),
    "biogpt": ("BioGptForCausalLM", "BioGptConfig", dict(_TXT, **_DROP)),
    # state-space and linear-attention decoders (no softmax attention at all)
    "mamba": ("MambaForCausalLM", "MambaConfig", dict(vocab_size=V, hidden_size=32, state_size=8, num_hidden_layers=2,
                                                      intermediate_size=64, expand=2, conv_kernel=4, time_step_rank=4)),
    "rwkv": ("RwkvForCausalLM", "RwkvConfig", dict(vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                                   attention_hidden_size=32, intermediate_size=64, context_length=64)),
}

_ENC = {
    "bert": ("BertForMaskedLM", "BertConfig", dict(_TXT, **_DROP)),
    "roberta": ("RobertaForMaskedLM", "RobertaConfig", dict(_TXT, **_DROP)),
    "xlm_roberta": ("XLMRobertaForMaskedLM", "XLMRobertaConfig", dict(_TXT, **_DROP)),
    "distilbert": ("DistilBertForMaskedLM", "DistilBertConfig", dict(vocab_size=V, dim=32, n_layers=2, n_heads=4,
                                                                     hidden_dim=64, max_position_embeddings=64,
                                                                     dropout=0.0, attention_dropout=0.0)),
    "electra": ("ElectraForMaskedLM", "ElectraConfig", dict(_TXT, embedding_size=16, **_DROP)),
    "deberta_v2": ("DebertaV2ForMaskedLM", "DebertaV2Config", dict(_TXT, **_DROP)),
    "deberta": ("DebertaForMaskedLM", "DebertaConfig", dict(_TXT, **_DROP)),
    "albert": ("AlbertForMaskedLM", "AlbertConfig", dict(_TXT, embedding_size=16, hidden_dropout_prob=0.0,
                                                          attention_probs_dropout_prob=0.0)),
    "mpnet": ("MPNetForMaskedLM", "MPNetConfig", dict(_TXT, **_DROP)),
    "convbert": ("ConvBertForMaskedLM", "ConvBertConfig", dict(_TXT, embedding_size=32, **_DROP)),
    "roformer": ("RoFormerForMaskedLM", "RoFormerConfig", dict(_TXT, embedding_size=32, **_DROP)),
    "megatron_bert": ("MegatronBertForMaskedLM", "MegatronBertConfig", dict(_TXT, **_DROP)),
    "ernie": ("ErnieForMaskedLM", "ErnieConfig", dict(_TXT, **_DROP)),
    "modernbert": ("ModernBertForMaskedLM", "ModernBertConfig", dict(_TXT, global_attn_every_n_layers=2,
                                                                     local_attention=4)),
    "squeezebert": ("SqueezeBertForMaskedLM", "SqueezeBertConfig", dict(_TXT, embedding_size=32, **_DROP)),
    "layoutlm": ("LayoutLMForMaskedLM", "LayoutLMConfig", dict(_TXT, max_2d_position_embeddings=64, **_DROP)),
}

_S2S = dict(vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            dropout=0.0, pad_token_id=0, decoder_start_token_id=2, eos_token_id=1, bos_token_id=2)
_T5 = dict(vocab_size=V, d_model=32, d_ff=64, d_kv=8, num_layers=1, num_heads=4, dropout_rate=0.0,
           decoder_start_token_id=0)

_ENCDEC = {
    "t5": ("T5ForConditionalGeneration", "T5Config", dict(_T5, feed_forward_proj="gated-gelu")),
    "mt5": ("MT5ForConditionalGeneration", "MT5Config", dict(_T5)),
    "umt5": ("UMT5ForConditionalGeneration", "UMT5Config", dict(_T5)),
    "longt5": ("LongT5ForConditionalGeneration", "LongT5Config", dict(_T5)),
    "bart": ("BartForConditionalGeneration", "BartConfig", dict(_S2S)),
    "mbart": ("MBartForConditionalGeneration", "MBartConfig", dict(_S2S)),
    "pegasus": ("PegasusForConditionalGeneration", "PegasusConfig", dict(_S2S)),
    "marian": ("MarianMTModel", "MarianConfig", dict(_S2S, decoder_vocab_size=V)),
    "blenderbot_small": ("BlenderbotSmallForConditionalGeneration", "BlenderbotSmallConfig", dict(_S2S)),
    "m2m_100": ("M2M100ForConditionalGeneration", "M2M100Config", dict(_S2S)),
    "led": ("LEDForConditionalGeneration", "LEDConfig", dict(
        {k: v for k, v in _S2S.items() if k != "max_position_embeddings"}, max_encoder_position_embeddings=64,
        max_decoder_position_embeddings=64, attention_window=[4])),
    "prophetnet": ("ProphetNetForConditionalGeneration", "ProphetNetConfig", dict(
        vocab_size=V, hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64, num_encoder_layers=1,
        num_decoder_layers=1, num_encoder_attention_heads=4, num_decoder_attention_heads=4, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, ngram=2, pad_token_id=0, decoder_start_token_id=2,
        eos_token_id=1, bos_token_id=2)),
}

for _n, (_m, _c, _k) in _DEC.items():
    family(_n, "decoder")(lambda m=_m, c=_c, k=_k: _causal(m, c, **k))
for _n, (_m, _c, _k) in _ENC.items():
    family(_n, "encoder")(lambda m=_m, c=_c, k=_k: _mlm(m, c, **k))
for _n, (_m, _c, _k) in _ENCDEC.items():
    family(_n, "encdec")(lambda m=_m, c=_c, k=_k: _s2s(m, c, **k))


def _image(model_cls: str, config_cls: str, size: int = 32, **cfg: Any) -> Built:
    model = _hf(model_cls, config_cls, num_labels=3, **cfg)
    return Built(model, {"pixel_values": torch.randn(B, 3, size, size), "labels": torch.randint(0, 3, (B,))})


_VIT = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, **_DROP)
_STAGES = dict(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1])

_VISION = {
    "vit": ("ViTForImageClassification", "ViTConfig", dict(_VIT)),
    "deit": ("DeiTForImageClassification", "DeiTConfig", dict(_VIT)),
    "beit": ("BeitForImageClassification", "BeitConfig", dict(_VIT, use_mean_pooling=True)),
    "dinov2": ("Dinov2ForImageClassification", "Dinov2Config", dict(_VIT)),
    "convnext": ("ConvNextForImageClassification", "ConvNextConfig", dict(_STAGES, num_stages=2)),
    "convnextv2": ("ConvNextV2ForImageClassification", "ConvNextV2Config", dict(_STAGES, num_stages=2)),
    "resnet": ("ResNetForImageClassification", "ResNetConfig", dict(embedding_size=8, hidden_sizes=[8, 16],
                                                                    depths=[1, 1], layer_type="basic")),
    "regnet": ("RegNetForImageClassification", "RegNetConfig", dict(embedding_size=8, hidden_sizes=[8, 16],
                                                                    depths=[1, 1], groups_width=4)),
    "swin": ("SwinForImageClassification", "SwinConfig", dict(image_size=32, patch_size=4, embed_dim=16,
                                                              depths=[1, 1], num_heads=[2, 2], window_size=4,
                                                              hidden_dropout_prob=0.0, drop_path_rate=0.0)),
    "mobilenet_v2": ("MobileNetV2ForImageClassification", "MobileNetV2Config", dict(image_size=32,
                                                                                    depth_multiplier=0.25)),
    "poolformer": ("PoolFormerForImageClassification", "PoolFormerConfig", dict(hidden_sizes=[8, 16],
                                                                                depths=[1, 1], num_encoder_blocks=2,
                                                                                patch_sizes=[7, 3], strides=[4, 2],
                                                                                padding=[2, 1], drop_path_rate=0.0)),
    "segformer": ("SegformerForImageClassification", "SegformerConfig", dict(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16], patch_sizes=[7, 3], strides=[4, 2],
        num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=16, drop_path_rate=0.0,
        classifier_dropout_prob=0.0, **_DROP)),
    "mobilevit": ("MobileViTForImageClassification", "MobileViTConfig", dict(
        image_size=32, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64], num_attention_heads=2,
        classifier_dropout_prob=0.0, **_DROP)),
}
for _n, (_m, _c, _k) in _VISION.items():
    family(_n, "vision")(lambda m=_m, c=_c, k=_k: _image(m, c, **k))

_AUDIO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=8,
              num_conv_pos_embedding_groups=4, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
              feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, num_labels=3,
              classifier_proj_size=16)


def _speech(model_cls: str, config_cls: str, **cfg: Any) -> Built:
    model = _hf(model_cls, config_cls, **dict(_AUDIO, **cfg))
    return Built(model, {"input_values": torch.randn(B, 800), "labels": torch.randint(0, 3, (B,))})


_SPEECH = {
    "wav2vec2": ("Wav2Vec2ForSequenceClassification", "Wav2Vec2Config", {}),
    "hubert": ("HubertForSequenceClassification", "HubertConfig", {}),
    "wavlm": ("WavLMForSequenceClassification", "WavLMConfig", {}),
    "data2vec_audio": ("Data2VecAudioForSequenceClassification", "Data2VecAudioConfig", {}),
    "unispeech": ("UniSpeechForSequenceClassification", "UniSpeechConfig", {}),
    "sew": ("SEWForSequenceClassification", "SEWConfig", {"squeeze_factor": 1}),
}
for _n, (_m, _c, _k) in _SPEECH.items():
    family(_n, "audio")(lambda m=_m, c=_c, k=_k: _speech(m, c, **k))


@family("whisper", "audio")
def _whisper() -> Built:
    model = _hf("WhisperForConditionalGeneration", "WhisperConfig", vocab_size=V, d_model=32, encoder_layers=1,
                decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=16, max_target_positions=32,
                dropout=0.0, pad_token_id=0, decoder_start_token_id=2, eos_token_id=1, bos_token_id=2,
                suppress_tokens=None, begin_suppress_tokens=None)
    return Built(model, {"input_features": torch.randn(B, 16, 32), "labels": _ids(6)})


class _Denoise(nn.Module):
    """A diffusers model under a training objective: predict the target from a noisy sample."""

    def __init__(self, net: nn.Module, cond: bool) -> None:
        super().__init__()
        self.net = net
        self.cond = cond

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor | None = None,
                target: torch.Tensor | None = None) -> Any:
        del target  # read by the loss
        if self.cond:
            return self.net(sample, timestep, encoder_hidden_states=context).sample
        return self.net(sample, timestep).sample


def _mse(out: Any, batch: Any) -> torch.Tensor:
    return (out.float() - batch["target"].float()).pow(2).mean()


def _mse_vae(out: Any, batch: Any) -> torch.Tensor:
    return (out.float() - batch["sample"].float()).pow(2).mean()


@family("diffusers_unet2d", "diffusers")
def _unet2d() -> Built:
    from diffusers import UNet2DModel

    net = UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
                      down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D",
                                                                                           "UpBlock2D"),
                      norm_num_groups=8, attention_head_dim=8)
    x = torch.randn(B, 3, 16, 16)
    return Built(_quiet(_Denoise(net, False)), {"sample": x, "timestep": torch.tensor([10, 500]),
                                                "target": torch.randn_like(x)}, None)


@family("diffusers_unet_cond", "diffusers")
def _unet_cond() -> Built:
    from diffusers import UNet2DConditionModel

    net = UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
                               block_out_channels=(16, 32), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                               up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
                               norm_num_groups=8, attention_head_dim=8)
    x = torch.randn(B, 4, 16, 16)
    return Built(_quiet(_Denoise(net, True)), {"sample": x, "timestep": torch.tensor([10, 500]),
                                               "context": torch.randn(B, 6, 16), "target": torch.randn_like(x)})


class _VAE(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, sample: torch.Tensor) -> torch.Tensor:
        return self.net(sample).sample


@family("diffusers_vae", "diffusers")
def _vae() -> Built:
    from diffusers import AutoencoderKL

    net = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(16, 32), layers_per_block=1,
                        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), latent_channels=4, norm_num_groups=8,
                        sample_size=16)
    return Built(_quiet(_VAE(net)), {"sample": torch.randn(B, 3, 16, 16)}, None)


def loss_for(name: str, built: Built) -> Callable[[Any, Any], torch.Tensor] | None:
    """The loss of a family: the model's own (``output.loss``) or an MSE objective for diffusers models."""
    if built.loss_fn is not None:
        return built.loss_fn
    if name == "diffusers_vae":
        return _mse_vae
    if FAMILIES[name].kind == "diffusers":
        return _mse
    return None


#: about ten families, one or two per kind, small and quick: the subset the test suite runs
FAST = ("llama", "gpt2", "bloom", "bert", "distilbert", "t5", "bart", "vit", "convnext", "wav2vec2")
