"""The decoding settings of a translation run (`DecodingSettings`), resolved once from a model's `generation_config`
and the caller's overrides, and read by every engine (`vaswani.translation`) and caller; and how training writes
them into a checkpoint (`write_decoding_defaults`). Apart from the engines, so that what only writes or reads the
settings (training, the attention heatmaps, `vaswani.loading` before it has chosen an engine) needs no engine."""

from __future__ import annotations

import dataclasses
import math

from .configuration_vaswani import longest_output, output_limit


GENERATE_DEFAULT_LENGTH_PENALTY = 1.0  # generate()'s, where the generation config says nothing
EARLY_STOPPING = (False, True, "never")


@dataclasses.dataclass(frozen=True)
class DecodingSettings:
    """The decoding settings of one translation run, resolved once (`resolve`) from a checkpoint's
    `generation_config` and the caller's overrides, and read by every engine and caller (`TorchEngine`,
    `CTranslate2Engine`, the file translator's resume record, validation and the test score), so that a sentence
    gets one translation whoever decodes it:

    * `num_beams`, `length_penalty`, `early_stopping`: beam search's (`length_penalty` and `early_stopping` are
      generate()'s defaults where the generation config has none); sampling (`do_sample`) means one beam unless
      the caller gives a beam count too;
    * each sentence's output limit (`output_limit`): `max_new_tokens` where one is given, else the one length rule
      (`configuration_vaswani.output_limit`: its own source's length plus `OUTPUT_SLACK`), never past
      `longest_output`, where the positions end;
    * `max_source_length`: where sources are truncated (`translate` warns, counting them);
    * `options`: the caller's other `generate()` options (temperature, no_repeat_ngram_size, …), which an engine
      that cannot follow them refuses by name;
    * `precision`: what the engine's weights compute in (set by the engine that holds them).
    """

    num_beams: int = 1
    do_sample: bool = False
    length_penalty: float = GENERATE_DEFAULT_LENGTH_PENALTY
    early_stopping: bool | str = False
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    longest_output: int | None = None
    max_source_length: int | None = None
    options: tuple[tuple[str, object], ...] = ()
    precision: str | None = None

    @classmethod
    def resolve(cls, generation_config, *, positions: int | None = None, learned: bool = False,
                origin: str = "generation_config", max_source_length: int | None = None,
                **overrides) -> "DecodingSettings":
        """The settings for a model whose `generation_config` (read from `origin`, named in errors) gives the
        defaults, with each of `overrides` that is not None over it. `positions`: the model's position count
        (`max_position_embeddings`), where sources are cut unless `max_source_length` says otherwise (never past
        `learned` positions), and where outputs stop (`configuration_vaswani.longest_output`). A value that
        generate() cannot decode with is refused in one line naming where it came from and the field."""
        given = {name: value for name, value in overrides.items() if value is not None}
        stored = {name: getattr(generation_config, name, None)
                  for name in ("num_beams", "do_sample", "length_penalty", "early_stopping", "max_new_tokens",
                               "min_new_tokens")}
        for name, value in stored.items():
            _check_setting(name, value, origin)
        for name, value in given.items():
            _check_setting(name, value, "the caller's options")
        if max_source_length is not None:
            _check_setting("max_source_length", max_source_length, "the caller's options")
        do_sample = bool(given.pop("do_sample", stored["do_sample"]))
        if "num_beams" in given:
            num_beams = given.pop("num_beams")
        else:  # sampling means one beam, unless the caller gives a count
            num_beams = 1 if do_sample else stored["num_beams"] or 1

        def setting(name, default):
            value = given.pop(name, stored[name])
            return default if value is None else value

        length_penalty = setting("length_penalty", GENERATE_DEFAULT_LENGTH_PENALTY)
        early_stopping = setting("early_stopping", False)
        max_new_tokens = setting("max_new_tokens", None)
        min_new_tokens = setting("min_new_tokens", 0)
        longest = positions - 1 if positions else None
        if max_source_length is None or (learned and positions and max_source_length > positions):
            max_source_length = positions if max_source_length is None else min(max_source_length, positions)
        return cls(num_beams=num_beams, do_sample=do_sample, length_penalty=float(length_penalty),
                   early_stopping=early_stopping, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                   longest_output=longest, max_source_length=max_source_length,
                   options=tuple(sorted(given.items())))

    def output_limit(self, source_length: int) -> int:
        """How many tokens (its end of sentence included) a sentence whose source has `source_length` tokens may be
        given: the package's one length rule."""
        return output_limit(source_length, self.max_new_tokens, self.longest_output)

    def generate_options(self) -> dict:
        """`generate()`'s keyword arguments for these settings, the output length aside (per sentence: see
        `TorchEngine`). Beam search's own settings go only with beams, where transformers accepts them."""
        options = {"num_beams": self.num_beams, "do_sample": self.do_sample, **dict(self.options)}
        if self.num_beams > 1:
            options |= {"length_penalty": self.length_penalty, "early_stopping": self.early_stopping}
        if self.min_new_tokens:
            options["min_new_tokens"] = self.min_new_tokens
        return options

    def record(self) -> dict:
        """What decides the outputs, as plain values (a resumed run compares them with its record)."""
        record = dataclasses.asdict(self)
        record["options"] = dict(self.options)
        return record


def _check_setting(name: str, value, origin: str) -> None:
    """Refuse, in one line naming `origin` and the field, a decoding setting generate() cannot honour."""
    if value is None:
        return
    counts = {"num_beams": 1, "max_new_tokens": 1, "max_source_length": 1, "min_new_tokens": 0}
    problem = None
    if name in counts and (isinstance(value, bool) or not isinstance(value, int) or value < counts[name]):
        problem = f"must be a whole number of at least {counts[name]}"
    elif name == "length_penalty" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                       or not math.isfinite(value)):
        problem = "must be a finite number"
    elif name == "early_stopping" and value not in EARLY_STOPPING:
        problem = "must be true, false or \"never\""
    elif name == "do_sample" and not isinstance(value, bool):
        problem = "must be true or false"
    if problem:
        raise ValueError(f"{origin}: {name}={value!r} cannot be decoded with; it {problem}.")

def write_decoding_defaults(generation_config, *, num_beams: int, length_penalty: float | None,
                            max_new_tokens: int | None = None, max_length: int | None = None) -> None:
    """Write the decoding settings a model is evaluated with into its `generation_config`, so that every later
    decoding uses them: our engines (`DecodingSettings.resolve`), and a stock `generate()` or `pipeline` (remote-code
    users). `length_penalty` is beam search's (transformers refuses it beside greedy search, so one beam drops it).
    `max_new_tokens` None keeps the one length rule of the engines (each source's length plus `OUTPUT_SLACK`), which
    `generate()` cannot express; it then needs `max_length`, the longest output the model allows (its
    `config.max_position_embeddings`), in place of `generate()`'s default of 20 tokens."""
    if max_new_tokens is None and max_length is None:
        raise ValueError("without max_new_tokens, give max_length (the model's max_position_embeddings): a stock "
                         "generate() would stop at 20 tokens.")
    generation_config.num_beams = num_beams
    generation_config.length_penalty = length_penalty if num_beams > 1 else None
    generation_config.max_new_tokens = max_new_tokens
    generation_config.max_length = None if max_new_tokens is not None else max_length


def model_decoding(model, origin: str = "generation_config", **overrides) -> DecodingSettings:
    """`DecodingSettings.resolve` for a model in memory: its own `generation_config` and position count (for a
    model of another type, which the pipeline may run: none)."""
    longest = longest_output(model.config)
    return DecodingSettings.resolve(model.generation_config, positions=None if longest is None else longest + 1,
                                    learned=is_learned(model.config), origin=origin, **overrides)


def is_learned(config) -> bool:
    """Whether `config`'s positions are a learned table, which ends."""
    return getattr(config, "position_embedding_type", None) == "learned"
