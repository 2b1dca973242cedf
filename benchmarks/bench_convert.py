"""A Marian / OPUS-MT model converted by `vaswani.convert.from_marian`, against the same `MarianMTModel`: the fp32
translations must be identical, and the report gives each of our decoding paths' speed and agreement.

No trained OPUS-MT model is reachable offline, so the Marian model is randomly initialised (Marian's own init) in
the shape of Helsinki-NLP/opus-mt-en-fr (transformer-base: d_model 512, 6+6 layers, 8 heads, FFN 2048, swish,
scaled embeddings, one shared 59,514-token vocabulary) with OPUS-MT's generation config (`bad_words_ids=[[pad]]`,
`forced_eos_token_id`). Its special ids are the project's joint BPE's (pad 0, eos 1, decoder start 3, where OPUS-MT
has pad = decoder start = the last id, eos 0), so that the converted model, saved with that tokenizer, is a checkpoint
the package's factory (`vaswani.loading.load_engine`) loads and checks as the scripts do. The sources are real English
sentences from the fra-eng corpus, tokenized by that BPE.

A random model rarely generates eos, so every engine runs exactly `--new_tokens` decoding steps
(`min_new_tokens` = `max_new_tokens`: eos is masked until the last step, where the forced eos ends every output),
with the generation config's logits processors in every engine alike, timed below the text
(`vaswani.translation.generate_token_ids`). Engines run in one process, interleaved batch by batch in rotating order,
`--repeats` times; a batch's time is the median of its repeats.

    python benchmarks/bench_convert.py --threads 2 --batch_size 32 --num_sentences 320
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from transformers import GenerationConfig, MarianConfig, MarianMTModel

from vaswani.batching import token_budget_batches
from vaswani.convert import from_marian
from vaswani.inference import keep_freed_cpu_memory
from vaswani.loading import load_engine
from vaswani.translation import generate_token_ids

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    Column, add_common_arguments, corpus_and_tokenizer, pick_device, report, sample_sentences, timed,
)

# Helsinki-NLP/opus-mt-en-fr's config.json, the fields that shape the model.
OPUS_MT_EN_FR = dict(
    vocab_size=59514, d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
    decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, activation_function="swish",
    scale_embedding=True, max_position_embeddings=512, share_encoder_decoder_embeddings=True,
)
# The converted checkpoint's engines, by `load_engine`'s decoding loop and int8.
ENGINES = {
    "marian": "Marian (HF)",
    "vaswani": "Vaswani",
    "vaswani-lean": "Vaswani lean",
    "vaswani-int8-lean": "Vaswani int8 lean (--int8)",
}


def opus_mt_base(tokenizer, seed: int) -> MarianMTModel:
    """The OPUS-MT-base-shaped Marian model with `tokenizer`'s special ids (see the module docstring)."""
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               decoder_start_token_id=tokenizer.bos_token_id)
    torch.manual_seed(seed)
    model = MarianMTModel(MarianConfig(**OPUS_MT_EN_FR, **ids, forced_eos_token_id=ids["eos_token_id"])).eval()
    model.generation_config = GenerationConfig(
        bad_words_ids=[[ids["pad_token_id"]]], forced_eos_token_id=ids["eos_token_id"], max_length=512, num_beams=4,
        renormalize_logits=True, **ids)
    return model


def build_engines(marian: MarianMTModel, tokenizer, directory: Path) -> dict:
    """The Marian model itself, and `from_marian` of it saved as a checkpoint beside `tokenizer` and loaded by the
    package's factory, once per decoding path."""
    from_marian(marian).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    engines = {"marian": marian}
    for name in list(ENGINES)[1:]:
        engines[name] = load_engine(str(directory), device="cpu", dtype="float32", int8="int8" in name,
                                    decoding="lean" if "lean" in name else "auto").model
    return engines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--num_sentences", type=int, default=320)
    parser.add_argument("--beams", default="1,4", help="comma-separated beam sizes")
    parser.add_argument("--new_tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    device = pick_device("cpu", args.threads)
    keep_freed_cpu_memory()
    corpus, pairs, tokenizer = corpus_and_tokenizer(args)
    sentences = [english for english, _ in sample_sentences(pairs, args.num_sentences, args.seed)]
    sources = tokenizer(sentences)["input_ids"]  # each ends with </s>
    batches = [tokenizer.pad({"input_ids": [sources[i] for i in batch]}, return_tensors="pt")
               for batch in token_budget_batches(list(map(len, sources)), None, max_sentences=args.batch_size)]
    with tempfile.TemporaryDirectory() as directory:
        engines = build_engines(opus_mt_base(tokenizer, args.seed), tokenizer, Path(directory))

    rows = []
    for beams in [int(b) for b in args.beams.split(",")]:
        settings = {"num_beams": beams, "max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens}
        outputs = {name: [None] * len(batches) for name in engines}
        seconds = {name: [[] for _ in batches] for name in engines}
        with torch.inference_mode():
            for model in engines.values():  # warm-up: the longest batch, untimed
                generate_token_ids(model, batches[0]["input_ids"], batches[0]["attention_mask"], **settings)
            order = list(engines)
            for repeat in range(args.repeats):
                for index, batch in enumerate(batches):
                    order = order[1:] + order[:1]  # rotate, so that load changes hit every engine alike
                    for name in order:
                        output, elapsed = timed(device, lambda: generate_token_ids(
                            engines[name], batch["input_ids"], batch["attention_mask"], **settings))
                        seconds[name][index].append(elapsed)
                        if outputs[name][index] is None:
                            outputs[name][index] = output
                        elif outputs[name][index] != output:
                            raise AssertionError(f"{name} is not deterministic")
        reference = [row for batch in outputs["marian"] for row in batch]
        marian_seconds = sum(statistics.median(times) for times in seconds["marian"])
        for name in engines:
            produced = [row for batch in outputs[name] for row in batch]
            # The last of the new tokens is the forced eos, which generate_token_ids leaves out.
            assert all(len(row) == args.new_tokens - 1 for row in produced), f"{name}: not {args.new_tokens} tokens"
            total = sum(statistics.median(times) for times in seconds[name])
            rows.append({
                "engine": ENGINES[name], "beams": beams, "batch": args.batch_size, "sentences": len(sentences),
                "seconds": total, "sentences_per_s": len(sentences) / total,
                "tokens_per_s": len(sentences) * args.new_tokens / total, "speedup": marian_seconds / total,
                "identical": sum(a == b for a, b in zip(produced, reference)) / len(reference),
            })
    columns = [Column("engine", "engine"), Column("batch", "batch"), Column("beams", "beams"),
               Column("sentences", "sentences"), Column("seconds", "seconds", "{:.2f}"),
               Column("sentences_per_s", "sentences/s", "{:.1f}"), Column("tokens_per_s", "output tokens/s", "{:.0f}"),
               Column("speedup", "× Marian", "{:.2f}"), Column("identical", "outputs = Marian's", "{:.1%}")]
    with open("/proc/loadavg") as file:
        load = file.read().split()[:3]
    notes = [
        f"{len(sentences)} English sentences drawn uniformly (seed {args.seed}) from {corpus.name}; source lengths "
        f"from the project's joint BPE ({len(tokenizer)} tokens, its eos included); batches sorted by length, the "
        "same for every engine.",
        "Random weights in the shape of Helsinki-NLP/opus-mt-en-fr (no trained OPUS-MT model is reachable "
        "offline), with the BPE's special ids; the Vaswani engines are `vaswani.convert.from_marian` of that same "
        "Marian model, saved with the BPE tokenizer and loaded by vaswani.loading.load_engine.",
        f"Every output is exactly {args.new_tokens} new tokens (min_new_tokens = max_new_tokens; Marian's "
        "generation config, copied by the conversion, forces eos at the last one); outputs are compared token for "
        "token with Marian's. Marian's logits processors (bad_words_ids=[[pad]], forced eos) run in every engine.",
        "Vaswani = load_engine(decoding='auto'): generate() of the converted model as users call it; lean = "
        "decoding='lean'; int8 lean = int8=True with decoding='lean', the scripts' --int8 path (int8 weights, so its "
        "outputs may differ).",
        f"Engines in one process, interleaved batch by batch in rotating order after one untimed warm-up batch; "
        f"seconds = sum over batches of the median of {args.repeats} repeats. Shared machine: load average "
        f"{' '.join(load)} at the end (1, 5, 15 min).",
    ]
    report(__file__, argv, args, device, "convert-marian", "Converted OPUS-MT-base vs MarianMTModel", rows, columns,
           notes)


if __name__ == "__main__":
    main()
