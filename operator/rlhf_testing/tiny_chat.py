"""A tiny chat model for multi-turn tests: a byte-level tokenizer with chat special tokens and a chat
template with tools, in two formats, and a random-init Qwen2 of its vocabulary (``build_tiny_chat_model``).

* ``chatml``: Qwen2.5's ChatML shape with Hermes tool calls (``<tool_call>{json}</tool_call>``; tool results as
  ``tool`` turns wrapped in ``<tool_response>``; parser ``hermes``); an assistant turn ends with ``<|im_end|>``
  and a newline.
* ``llama3``: Llama 3's header shape (``<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>``, nothing
  after the end of a turn), tool calls as a JSON object (parser ``llama3_json``), tool results in ``ipython``
  turns; it drops the text of earlier assistant turns that made a tool call, as reasoning templates do with
  earlier reasoning, which is what token-in-token-out must survive.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL = ["<pad>", "<unk>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
           "<tool_response>", "</tool_response>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<|python_tag|>"]
VOCAB = 320  # the 256 byte symbols, the special tokens, padding to a multiple of 64

CHATML = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>tool\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA3 = (
    "<bos>{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nTools:"
    "{% for t in tools %} {{ t.function.name }}{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", \"parameters\": "
    "{{ c.function.arguments | tojson }}}{% endfor %}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

TEMPLATES = {"chatml": (CHATML, "<|im_end|>"), "llama3": (LLAMA3, "<|eot_id|>")}


def build_chat_tokenizer(path: str | Path, template: str = "chatml") -> None:
    """A byte-level tokenizer without merges (one token per byte, as Qwen's tokenizer is before its merges, so
    Qwen2's tokenizer class loads it as it is), the chat special tokens and ``template``'s chat template, saved to
    ``path``; its eos is the template's end-of-turn token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chat_template, eos = TEMPLATES[template]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = SPECIAL + alphabet
    tokens += [f"<extra_{i}>" for i in range(VOCAB - len(tokens))]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>",
                                   eos_token=eos)
    fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    config = Path(path) / "config.json"
    if not config.exists():  # loaded as the model's tokenizer class is (Qwen2's), as the runtime loads it
        config.write_text('{"model_type": "qwen2"}')


def build_tiny_chat_model(path: str | Path, template: str = "chatml", *, hidden_size: int = 128, layers: int = 2,
                          seed: int = 0) -> Path:
    """A random-init tiny Qwen2 of the chat vocabulary and ``build_chat_tokenizer``'s tokenizer at ``path``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    eos = SPECIAL.index(TEMPLATES[template][1])
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=hidden_size // 2, max_position_embeddings=1024, tie_word_embeddings=False,
                      bos_token_id=2, eos_token_id=eos, pad_token_id=0)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg).to(torch.float32).save_pretrained(str(path))
    build_chat_tokenizer(path, template)  # after the model: its config.json stays
    return path
