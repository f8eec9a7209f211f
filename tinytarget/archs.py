"""Tiny random-weight targets of real architectures, built in seconds for tests.

The committed tiny target (``assets/tiny-target``) is a trained Llama; real targets are Qwen3,
MoE, gpt-oss, MLA, partial-rotary and multimodal wrappers whose configs, tensor names and vLLM
kernels differ. :func:`build` writes a Hugging Face directory of one of :data:`ARCHS` with seeded
random weights (hidden 128, 8 layers, so vLLM's default EAGLE-3 aux layers (2, 4, 5) are distinct)
and the tiny target's tokenizer and chat template (vocab = that tokenizer's 1141 ids, plus four
vision tokens for Qwen3-VL; bos/eos/pad kept). The trade-off: random weights say nothing about
draft quality, but they exercise every loader, kernel and key lookup a real checkpoint of the same
architecture does, at no download.

transformers 5.19's ``save_pretrained`` drops config keys vLLM 0.32 reads and released checkpoints
carry (DeepSeek ``topk_method``, MiniMax-M2 ``rotary_dim`` / ``scoring_func`` / ``use_routing_bias``);
:data:`SPECS` adds them back, with ``torch_dtype`` beside transformers 5's ``dtype``.

    python -m eaglenest.tinytarget.archs qwen3_moe /tmp/tiny-qwen3-moe
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any, Callable, Literal

from eaglenest.cli import Command, path_arg
from eaglenest.errors import ConfigError
from eaglenest.launch import execute
from eaglenest.paths import staged_dir
from eaglenest.tinytarget.build import is_model_folder

#: The committed tiny target, whose tokenizer and chat template every built target reuses.
TOKENIZER_SOURCE = Path(__file__).resolve().parent.parent / "assets" / "tiny-target"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
HIDDEN_SIZE = 128
NUM_LAYERS = 8
SEED = 0
#: Qwen3-VL's processor finds images and videos by these tokens; the wrapper adds them after the
#: tiny tokenizer's ids (so text prompts tokenize exactly as for the other targets).
QWEN3_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spec:
    #: (shared kwargs: vocab, token ids, hidden, layers; ids of ``added_tokens``) -> a transformers config.
    config: Callable[[dict[str, Any], dict[str, int]], Any]
    dtype: str = "float32"
    #: Keys released checkpoints carry that ``save_pretrained`` leaves out (written into config.json).
    extra_keys: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Special tokens appended to the tokenizer (multimodal placeholders).
    added_tokens: tuple[str, ...] = ()
    #: "causal_lm" (AutoModelForCausalLM) or "image_text" (AutoModelForImageTextToText).
    auto_class: Literal["causal_lm", "image_text"] = "causal_lm"


#: Released Qwen3 / Qwen3-MoE rope.
QWEN3_ROPE = {"rope_type": "default", "rope_theta": 1000000.0}


def _attention(num_kv_heads: int = 2, head_dim: int = 32) -> dict[str, Any]:
    return {"num_attention_heads": 4, "num_key_value_heads": num_kv_heads, "head_dim": head_dim}


def _qwen3(c, ids):
    from transformers import Qwen3Config

    return Qwen3Config(**c, **_attention(), intermediate_size=256, max_position_embeddings=32768,
                       rope_parameters=QWEN3_ROPE)


def _qwen3_moe(c, ids):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**c, **_attention(), intermediate_size=256, moe_intermediate_size=64, num_experts=4,
                          num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                          max_position_embeddings=32768, rope_parameters=QWEN3_ROPE)


def _gpt_oss(c, ids):
    from transformers import GptOssConfig

    # Alternating sliding (window 128) and full attention layers with sinks, as the released models.
    return GptOssConfig(**c, **_attention(), intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                        sliding_window=128)


def _llama_tied(c, ids):
    from transformers import LlamaConfig

    # Shaped like Llama-3.2-1B: tied embeddings, bf16, llama3 rope scaling.
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return LlamaConfig(**{**c, "tie_word_embeddings": True}, **_attention(), intermediate_size=256,
                       max_position_embeddings=32768, rope_parameters=rope)


def _deepseek_v3(c, ids):
    from transformers import DeepseekV3Config

    # MLA with the one latent shape vLLM's CPU MLA backend supports: kv_lora_rank 512 + rope 64
    # (a 576-wide latent head, as the released DeepSeek-V3). Layer 0 dense, layers 1-7 MoE.
    return DeepseekV3Config(**c, num_attention_heads=4, num_key_value_heads=4, intermediate_size=256,
                            moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1,
                            num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                            routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=512, q_lora_rank=64,
                            qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=32768)


def _minimax_m2(c, ids):
    from transformers import MiniMaxM2Config

    # Partial rotary: rope on the first half of each 32-wide head (released M2: 64 of 128).
    return MiniMaxM2Config(**c, **_attention(), intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                           rotary_dim=16, max_position_embeddings=32768)


def _qwen3_vl(c, ids):
    from transformers import Qwen3VLConfig

    text = {**c, **_attention(), "intermediate_size": 256, "max_position_embeddings": 32768,
            # Qwen3-VL's interleaved multimodal rope; text tokens get the same position on all 3 axes.
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [8, 4, 4],
                                "mrope_interleaved": True}}
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": HIDDEN_SIZE,
              "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64,
              "deepstack_visual_indexes": [0]}
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                         vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                         image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"])


SPECS: dict[str, Spec] = {
    "qwen3": Spec(config=_qwen3),
    "qwen3_moe": Spec(config=_qwen3_moe),
    "gpt_oss": Spec(config=_gpt_oss),
    "llama_tied_bf16": Spec(config=_llama_tied, dtype="bfloat16"),
    "deepseek_v3": Spec(config=_deepseek_v3, extra_keys={"topk_method": "noaux_tc", "scoring_func": "sigmoid"}),
    "minimax_m2": Spec(config=_minimax_m2, extra_keys={"rotary_dim": 16, "scoring_func": "sigmoid",
                                                       "use_routing_bias": True}),
    "qwen3_vl": Spec(config=_qwen3_vl, added_tokens=QWEN3_VL_TOKENS, auto_class="image_text"),
}
ARCHS: tuple[str, ...] = tuple(SPECS)


def _tokenizer(out: Path, added: tuple[str, ...]) -> dict[str, Any]:
    """Copy the tiny target's tokenizer into ``out`` (plus ``added`` special tokens); its ids."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy2(TOKENIZER_SOURCE / name, out / name)
    tok = AutoTokenizer.from_pretrained(str(out))
    if added:
        tok.add_special_tokens({"additional_special_tokens": list(added)})
        tok.save_pretrained(str(out))
    return {"vocab_size": len(tok), "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id, "added_ids": {t: tok.convert_tokens_to_ids(t) for t in added}}


def _randomise_routing_bias(model, gen) -> None:
    """Routers' ``e_score_correction_bias`` starts at zero; small random values make the stored
    bias matter, as in a trained checkpoint."""
    import torch

    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)


def build(arch: str, out: Path, *, seed: int = SEED) -> Path:
    """Write a random-weight ``arch`` target to ``out`` (a Hugging Face directory); returns ``out``.
    Same ``arch`` and ``seed``, same software stack: the same bytes. The folder is written whole or
    not at all (built beside ``out``, then renamed): an earlier model there is replaced, a folder of
    other files refused (ConfigError)."""
    if arch not in SPECS:
        raise ValueError(f"unknown architecture {arch!r}; one of {', '.join(ARCHS)}")
    with staged_dir(out, "OUT_DIR", replaces=is_model_folder, error=ConfigError) as tmp:
        _write(SPECS[arch], tmp, seed=seed)
    return Path(out)


def _write(spec: Spec, out: Path, *, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig

    ids = _tokenizer(out, spec.added_tokens)
    shared = {"vocab_size": ids["vocab_size"], "bos_token_id": ids["bos_token_id"],
              "eos_token_id": ids["eos_token_id"], "pad_token_id": ids["pad_token_id"],
              "hidden_size": HIDDEN_SIZE, "num_hidden_layers": NUM_LAYERS, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False}
    cfg = spec.config(shared, ids["added_ids"])
    torch.manual_seed(seed)
    auto = AutoModelForCausalLM if spec.auto_class == "causal_lm" else AutoModelForImageTextToText
    model = auto.from_config(cfg, dtype=torch.float32).eval()
    _randomise_routing_bias(model, torch.Generator().manual_seed(seed + 1))
    model.to(getattr(torch, spec.dtype)).save_pretrained(str(out))
    path = out / "config.json"
    config = json.loads(path.read_text())
    config.update(spec.extra_keys)
    config["dtype"] = config["torch_dtype"] = spec.dtype
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    GenerationConfig(bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"],
                     pad_token_id=ids["pad_token_id"]).save_pretrained(str(out))
    if spec.auto_class == "image_text":
        _processor_files(out)


def _processor_files(out: Path) -> None:
    """Qwen3-VL's image and video processor files (the released layout), with the pixel budget capped
    at 64x64 per image so that a processor built from them yields few patches for the tiny tower."""
    pixels = {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}
    common = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "size": pixels,
              "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    (out / "preprocessor_config.json").write_text(json.dumps(
        {**common, "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor"},
        indent=2) + "\n")
    (out / "video_preprocessor_config.json").write_text(json.dumps(
        {**common, "video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor",
         "fps": 2, "min_frames": 2, "max_frames": 4}, indent=2) + "\n")


PROG = "python -m eaglenest.tinytarget.archs"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("arch", metavar="ARCH", help=f"one of {', '.join(ARCHS)}")
    p.add_argument("out", type=path_arg, metavar="OUT_DIR", help="the Hugging Face folder to write")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    args = p.parse_args(argv)
    # The shared CLI layer: logging, the process guard, one-line errors (exit 2), Ctrl-C and SIGTERM
    # unwinding through the staged folder's cleanup, as every stage command does.
    return execute(PROG, Command(fn=run, help=p.description, needs_recipe=False), args)


def run(recipe: None, args: argparse.Namespace) -> int:
    """The command's body: build ``args.arch`` into ``args.out`` and print the folder."""
    if args.arch not in SPECS:
        raise ConfigError(f"unknown architecture {args.arch!r}; one of {', '.join(ARCHS)}")
    print(build(args.arch, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
