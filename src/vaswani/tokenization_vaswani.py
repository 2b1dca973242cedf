"""One subword vocabulary shared by English and French, as in the paper's Section 5.1.

The paper encodes WMT'14 En-De with byte-pair encoding (Sennrich et al., 2016) over about 37,000 tokens
shared by source and target, which lets the model tie its embedding matrices (En-Fr used 32,000 word pieces).
We use BPE for En-Fr too, rather than a Unigram model: its greedy merges split a given word the same way
wherever it occurs, and training it on the whole Tatoeba corpus takes seconds.

The pipeline, from raw text to ids and back:
  normalise   NFKC, then runs of whitespace become one space. NFKC turns the narrow and ordinary no-break
              spaces that French typography puts before `! ? : ;` (U+202F, U+00A0) into a plain space, so
              "calme\u202f!" and "calme !" are the same token sequence and decode to "calme !".
  pre-split   on spaces, each word carrying its leading space as "▁" (SentencePiece's convention), so that
              decoding restores every space exactly and never glues punctuation to the preceding word.
              Punctuation at the edges of a word is split off too ("wants." -> "▁wants" "."), as the Moses
              tokenisation under Sennrich et al.'s BPE did, so "wants." and "wants" share one subword;
              apostrophes and hyphens inside words stay ("l'a", "don't", "est-il").
  BPE         with byte fallback (as in Llama): a character the training text never showed becomes its
              UTF-8 bytes, <0x00>..<0xFF>, instead of <unk>, so any input round-trips.
  post-proc   appends </s> to sources and to labels, like Marian and T5; the decoder starts from <s>.

This file is shipped next to the model weights (`trust_remote_code`), so it imports only `tokenizers` and
`transformers`.
"""

import json
from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from transformers import TokenizersBackend

PAD_TOKEN, EOS_TOKEN, UNK_TOKEN, BOS_TOKEN = "<pad>", "</s>", "<unk>", "<s>"
# Their position in this list is their id; VaswaniConfig's pad/eos/bos/decoder_start ids rely on it.
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, UNK_TOKEN, BOS_TOKEN]
BYTE_TOKENS = [f"<0x{byte:02X}>" for byte in range(256)]
WORD_START = "▁"
# A merge seen once in the training text is memorising a single sentence rather than learning a subword.
MIN_MERGE_FREQUENCY = 2


def _build_backend(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    """The `tokenizers` pipeline described in the module docstring, around a given BPE vocabulary."""
    backend = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=UNK_TOKEN, byte_fallback=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip()]
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement=WORD_START, prepend_scheme="always", split=True),
            # A leading "▁" stays with its punctuation: French "calme !" keeps "▁!" as one token.
            pre_tokenizers.Split(Regex(rf"^{WORD_START}?\p{{P}}+|\p{{P}}+$"), behavior="isolated"),
        ]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.ByteFallback(),  # <0xC3> <0xA9> -> "é"
            decoders.Metaspace(replacement=WORD_START, prepend_scheme="always", split=True),
        ]
    )
    return backend


class VaswaniTokenizer(TokenizersBackend):
    """Joint English-French BPE tokenizer: `<pad>`=0, `</s>`=1 (eos), `<unk>`=2, `<s>`=3 (decoder start).

    Build one with `train_tokenizer`, or load one with `VaswaniTokenizer.from_pretrained` /
    `AutoTokenizer.from_pretrained`, which refuse a directory or Hub repository without tokenizer.json. Called
    without a vocabulary it can only spell text byte by byte.

    `tokenizer(sources, text_target=targets)` returns `input_ids`, `attention_mask` and `labels`, each ending
    in `</s>`. Decoding never runs transformers' `clean_up_tokenization_spaces`, which deletes the space before
    "!" and "?" and would turn French "Je suis calme !" into "Je suis calme!".
    """

    vocab_files_names = {"tokenizer_file": "tokenizer.json"}
    model_input_names = ["input_ids", "attention_mask"]
    model = BPE

    def __init__(
        self,
        vocab: dict[str, int] | None = None,
        merges: list[tuple[str, str]] | None = None,
        pad_token: str = PAD_TOKEN,
        eos_token: str = EOS_TOKEN,
        unk_token: str = UNK_TOKEN,
        bos_token: str = BOS_TOKEN,
        **kwargs,
    ):
        if vocab is None:
            vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + BYTE_TOKENS)}
        self._tokenizer = _build_backend(vocab, merges or [])
        # A saved tokenizer_config.json carries these too; setdefault lets its values through.
        kwargs.setdefault("add_bos_token", False)
        kwargs.setdefault("add_eos_token", True)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(
            pad_token=pad_token, eos_token=eos_token, unk_token=unk_token, bos_token=bos_token, **kwargs
        )

    @classmethod
    def _from_pretrained(cls, resolved_vocab_files, pretrained_model_name_or_path, *args, **kwargs):
        # transformers builds the tokenizer from whatever files it found, even none: without tokenizer.json this
        # would be the byte-only tokenizer of `VaswaniTokenizer()`, whose ids mean nothing to a trained model.
        if resolved_vocab_files.get("tokenizer_file") is None:
            missing = [name for name, key in (("tokenizer.json", "tokenizer_file"),
                                              ("tokenizer_config.json", "tokenizer_config_file"))
                       if resolved_vocab_files.get(key) is None]
            raise FileNotFoundError(
                f"{pretrained_model_name_or_path} has no Vaswani tokenizer: {' and '.join(missing)} "
                f"{'are' if len(missing) > 1 else 'is'} missing. Copy the tokenizer files from the directory the model "
                "was trained in (train_translation.py saves them beside the weights), or save them there with "
                "`tokenizer.save_pretrained(...)`."
            )
        return super()._from_pretrained(resolved_vocab_files, pretrained_model_name_or_path, *args, **kwargs)

    @classmethod
    def encodes_words_independently(cls, tokenizer) -> bool:
        """Whether `tokenizer` (any fast tokenizer, this class or not) normalises and cuts text at its spaces as this
        class's pipeline does, before BPE: then each word is encoded on its own, and a sentence's ids are its words'
        ids end to end, so that words can be encoded once and looked up (`vaswani.tokenization.WordCachedEncoder`)."""
        if not getattr(tokenizer, "is_fast", False):
            return False
        reference = json.loads(_build_backend({}, []).to_str())
        state = json.loads(tokenizer.backend_tokenizer.to_str())
        return all(state[part] == reference[part] for part in ("normalizer", "pre_tokenizer"))


# save_pretrained copies this file next to the vocabulary and writes `auto_map` in tokenizer_config.json,
# so `AutoTokenizer.from_pretrained(path, trust_remote_code=True)` works where `vaswani` is not installed.
VaswaniTokenizer.register_for_auto_class("AutoTokenizer")


def train_tokenizer(texts: Iterable[str], vocab_size: int, **tokenizer_kwargs) -> VaswaniTokenizer:
    """Learn the joint BPE vocabulary from English and French sentences (mix both languages in `texts`).

    `vocab_size` is the total: the 4 special tokens, the 256 byte-fallback tokens, the characters seen and the
    merges (fewer if the text offers too few merges seen twice). `tokenizer_kwargs` go to `VaswaniTokenizer`
    (e.g. `model_max_length`).
    """
    reserved = len(SPECIAL_TOKENS) + len(BYTE_TOKENS)
    if vocab_size <= reserved:
        raise ValueError(
            f"vocab_size={vocab_size} leaves no room for subwords: {len(SPECIAL_TOKENS)} special and "
            f"{len(BYTE_TOKENS)} byte tokens are always included. Use a vocab_size well above {reserved}."
        )
    backend = _build_backend({}, [])
    trainer = BpeTrainer(
        vocab_size=vocab_size - len(BYTE_TOKENS),
        min_frequency=MIN_MERGE_FREQUENCY,
        special_tokens=SPECIAL_TOKENS,  # the trainer gives them ids 0..3 in this order
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)

    learned = json.loads(backend.to_str())["model"]
    vocab = learned["vocab"]
    # Byte tokens go last so that the learned ids stay as the trainer numbered them.
    for token in BYTE_TOKENS:
        if token not in vocab:
            vocab[token] = len(vocab)
    merges = [tuple(merge) for merge in learned["merges"]]
    return VaswaniTokenizer(vocab=vocab, merges=merges, **tokenizer_kwargs)

