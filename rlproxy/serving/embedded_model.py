"""The embedded default model: generated once, deterministically, into a cache directory.

No weights can be downloaded where rlproxy is developed and tested, so it makes its own: a real
mlx-lm architecture (qwen3) with seeded random weights, a byte-level BPE tokenizer trained offline
with `tokenizers` on a corpus that ships inside the package, and a Qwen-style chat template that
renders tools and `<tool_call>{json}</tool_call>`. The result is an ordinary model directory that
`mlx_lm.load(path)` opens, so serving it is the same code path as `--model <path or hub id>`.

This module only writes the directory; loading belongs to `rlproxy.model`.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlproxy.serving.model_fetch import build_once, model_cache_dir

# Bump when anything below changes what is generated: old directories are then left unused.
# v2: a 131,072-token window (v1: 40,960), the same weights.
GENERATOR_VERSION = 2
WEIGHT_SEED = 1000  # v1's seed, kept: tests and benchmarks saw these weights

SIZES = {
    # name: (hidden, layers, heads, kv_heads, intermediate). Measured here: "tiny" (~1M params)
    # prefills a 15.6k-token agent prompt in ~11 s on 2 cores; "small" (~11M) takes ~78 s.
    "tiny": (128, 2, 4, 2, 384),
    "small": (384, 6, 6, 2, 1024),
}
VOCAB_SIZE = 4096
CONTEXT_TOKENS = 131072  # Hermes Agent refuses < 64k; Claude Code sends ~36k-token first turns

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added but not "special": they decode to text, so the tool parser can see them.
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}\
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
{%- if loop.first and not message.content %}{% else %}
{% endif %}<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user
{% endif %}<tool_response>
{{ message.content }}
</tool_response>
{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def embedded_model_path(size: str = "tiny", cache_dir: Path | None = None) -> Path:
    """Return the directory of the embedded model of `size`, generating it on first use."""
    if size not in SIZES:
        raise ValueError(f"unknown embedded model size {size!r}; choose one of {sorted(SIZES)}")
    path = Path(cache_dir or model_cache_dir()) / f"embedded-{size}-v{GENERATOR_VERSION}"
    return build_once(path, lambda tmp: write_embedded_model(tmp, size))


def write_embedded_model(path: Path, size: str) -> None:
    from rlproxy.ops import progress

    with progress.phase(f"generated the embedded {size} model"), progress.bar(
            total=3, desc=f"generating the embedded {size} model", unit="part") as done:
        fast_tokenizer = train_tokenizer()
        done.update()
        write_tokenizer(path, fast_tokenizer)
        done.update()
        write_weights(path, size, vocab_size=len(fast_tokenizer))
        done.update()


def corpus_lines() -> list[str]:
    text = (Path(__file__).parent / "embedded_corpus.txt").read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line.strip()]
    # Chat markup in the corpus teaches merges for the spans every prompt contains.
    return lines + [f"<|im_start|>{role}\n" for role in ("system", "user", "assistant")]


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    tok.add_tokens(MARKUP_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=CONTEXT_TOKENS,
    )


def write_tokenizer(path: Path, fast_tokenizer) -> None:
    fast_tokenizer.save_pretrained(str(path))
    # generation_config names both end tokens, so a raw-completion caller stops at either.
    ids = [fast_tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}, indent=2))


def model_config(size: str, vocab_size: int) -> dict:
    hidden, layers, heads, kv_heads, intermediate = SIZES[size]
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": CONTEXT_TOKENS,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "eos_token_id": None,  # filled from the tokenizer by write_weights
        "rlproxy_embedded": {"size": size, "generator_version": GENERATOR_VERSION},
    }


def write_weights(path: Path, size: str, vocab_size: int) -> None:
    import mlx.core as mx
    from mlx_lm.models import qwen3
    from mlx_lm.utils import save_config, save_model
    from transformers import AutoTokenizer

    config = model_config(size, vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    config["eos_token_id"] = tokenizer.convert_tokens_to_ids("<|im_end|>")
    mx.random.seed(WEIGHT_SEED + list(SIZES).index(size))
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(config, path / "config.json")
