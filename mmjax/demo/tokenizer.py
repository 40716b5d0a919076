"""The mmjax-shapes tokenizer: a small byte-level BPE plus a LLaVA-1.5-style chat template.

Design
------
* Byte-level BPE (`tokenizers`), 256-byte initial alphabet, so ANY text tokenizes (no <unk>
  is ever produced; it exists only because the HF configs expect one).
* Special tokens, fixed ids (Llama conventions): <unk>=0, <s>=1, </s>=2, <pad>=3, <image>=4.
* Pre-tokenization puts the space AFTER a word ("circle " / "and "), not before it as GPT-2
  does ("Ġcircle"). Reason: the generation prompt ends in "ASSISTANT: " and the answer that
  follows then starts a fresh pre-token, so
    - the prompt's tokens are an exact prefix of the tokens of prompt + answer (training and
      serving see the same ids), and
    - the model emits "circle", not " circle": decoded answers need no stripping.
  Pattern: letters+optional space | one digit+optional space | punctuation run+optional space
  | whitespace run.
* Post-processor (TemplateProcessing) prepends <s> on plain `encode(text)`. The chat template
  itself starts with {{ bos_token }}, so a rendered chat must be encoded with
  add_special_tokens=False (that is what transformers' apply_chat_template(tokenize=True)
  does, and what `encode_chat` here does).

Chat format (Vicuna v1 / LLaVA-1.5):

    <s>[system text ]USER: What shape is this? <image>\\nASSISTANT: circle</s>USER: ... ASSISTANT: 

* system: its text followed by one space, no role prefix (LLaVA-1.5's conv_vicuna_v1).
* user: "USER: ", then each text part followed by one space, then every image part as
  "<image>\\n" (in order). Question BEFORE image, unlike llava-hf's template: the decoder is
  causal, so only image tokens that come after the question can look for what it asks about
  ("Is there a red circle?"); with the image first, "exists" sat at chance for 5,500 steps.
  Whatever order a client sends the parts in, the rendered prompt is the same.
* assistant: "ASSISTANT: " + text + "</s>".
* add_generation_prompt: "ASSISTANT: " (trailing space; see pre-tokenization above).
* content may be a string or an OpenAI-style list of parts: {"type": "text", "text": ...},
  {"type": "image"} ({"type": "image_url"} / {"type": "input_image"} count as images too).
"""
from __future__ import annotations

import functools
import itertools
import json
import os

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "<image>")
UNK, BOS, EOS, PAD, IMAGE = SPECIAL_TOKENS
UNK_ID, BOS_ID, EOS_ID, PAD_ID, IMAGE_ID = range(len(SPECIAL_TOKENS))
DEFAULT_VOCAB_SIZE = 384
PRETOKENIZE_PATTERN = r"\p{L}+ ?|\p{N} ?|[^\s\p{L}\p{N}]+ ?|\s+"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}"
    "{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] == 'system' %}"
    "{% for p in parts %}{% if p['type'] == 'text' %}{{ p['text'] + ' ' }}{% endif %}{% endfor %}"
    "{% elif message['role'] == 'user' %}"
    "{{ 'USER: ' }}"
    "{% for p in parts %}{% if p['type'] == 'text' %}{{ p['text'] + ' ' }}{% endif %}{% endfor %}"
    "{% for p in parts %}{% if p['type'] in ['image', 'image_url', 'input_image'] %}"
    "{{ '<image>\\n' }}{% endif %}{% endfor %}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ 'ASSISTANT: ' }}"
    "{% for p in parts %}{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT: ' }}{% endif %}"
)


def training_corpus() -> list[str]:
    """Every question, answer and chat fragment the demo uses, rendered as the model sees them,
    plus a little general English so common words are not all single bytes."""
    from mmjax.demo import shapes as S

    phrases = [f"a {c} {k}" for c in S.COLORS for k in S.SHAPES]
    answers = list(S.SHAPES) + list(S.COLORS) + ["1", "2", "3", "yes", "no"] + phrases
    answers += [f"{a} and {b}" for a, b in itertools.product(phrases, repeat=2)]
    answers += [f"{a}, {b} and {c}" for a, b, c in itertools.product(phrases[::2], repeat=3)]
    questions = [S.Q_SHAPE, S.Q_COLOR, S.Q_COUNT, S.Q_DESCRIBE]
    questions += [S.exists_question(c, k) for c in S.COLORS for k in S.SHAPES]
    corpus = []
    for q, a in itertools.product(questions, answers[:40]):
        corpus.append(f"USER: {q} {IMAGE}\nASSISTANT: {a}{EOS}")
    corpus += [f"ASSISTANT: {a}{EOS}" for a in answers] * 4
    corpus += ["A chat between a curious user and an artificial intelligence assistant. "
               "The assistant gives helpful, detailed, and polite answers to the user's "
               "questions. What is in the picture? Is it a shape, a color, a number? "
               "Count the shapes from left to right. There are two of them here."] * 8
    return corpus


def train_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Train the byte-level BPE. Deterministic for a given corpus and vocab size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())   # byte-level: no unk needed, every byte is in the alphabet
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)])
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def tokenizer_config(model_max_length: int = 512) -> dict:
    """tokenizer_config.json contents (read by transformers' AutoTokenizer and by mmjax)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
        "extra_special_tokens": {"image_token": IMAGE},
        "model_max_length": model_max_length,
        "padding_side": "left",
        "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(SPECIAL_TOKENS)},
    }


def save_tokenizer(tok, out_dir: str, model_max_length: int = 512) -> None:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(model_max_length), f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
                   "additional_special_tokens": [IMAGE]}, f, indent=2)


@functools.lru_cache(maxsize=1)
def _chat_template():
    # compiling the template costs ~11 ms, rendering it ~0.1 ms: training renders thousands
    import jinja2

    return jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(CHAT_TEMPLATE)


def render_chat(messages: list, add_generation_prompt: bool = False) -> str:
    """Render CHAT_TEMPLATE with plain jinja2 (same environment knobs as transformers)."""
    return _chat_template().render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token=BOS, eos_token=EOS)


def encode_chat(tok, messages: list, add_generation_prompt: bool = False) -> list[int]:
    """Token ids of a chat: rendered template, encoded WITHOUT the post-processor's BOS."""
    return tok.encode(render_chat(messages, add_generation_prompt),
                      add_special_tokens=False).ids


def vqa_messages(question: str, answer: str | None = None, system: str | None = None) -> list:
    """The single-turn conversation the demo trains on (the template renders the question
    before the image), after an optional system prompt."""
    msgs = [{"role": "system", "content": system}] if system else []
    msgs.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]})
    if answer is not None:
        msgs.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    return msgs
