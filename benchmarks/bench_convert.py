"""A Marian / OPUS-MT model converted by `vaswani.convert.from_marian`, against the same `MarianMTModel`: the fp32
translations must be identical, and the report gives each of our decoding paths' speed and agreement.

No trained OPUS-MT model is reachable offline, so the Marian model is randomly initialised (Marian's own init) in
the shape of Helsinki-NLP/opus-mt-en-fr (transformer-base: d_model 512, 6+6 layers, 8 heads, FFN 2048, swish,
scaled embeddings, one shared 59,514-token vocabulary, pad = decoder start = the last id, eos 0) with OPUS-MT's
generation config (bad_words_ids=[[pad]], forced_eos_token_id=0). The sources are real English sentences from the
fra-eng corpus, tokenized by the project's joint BPE for their lengths (ids < 32,000, then Marian's eos 0).

A random model rarely generates eos, so every engine runs exactly `--new_tokens` decoding steps
(`min_new_tokens` = `max_new_tokens`: eos is masked until the last step, where Marian's forced eos ends every
output), with the generation config's logits processors in every engine alike. Engines run in one process,
interleaved batch by batch in rotating order, `--repeats` times; a batch's time is the median of its repeats.

    python benchmarks/bench_convert.py --threads 2 --batch_size 32 --num_sentences 320
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch
from transformers import GenerationConfig, MarianConfig, MarianMTModel

from vaswani.convert import from_marian
from vaswani.decoding import use_lean_decoding
from vaswani.inference import keep_freed_cpu_memory, quantize_for_cpu

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    Column,
    add_common_arguments,
    command_line,
    corpus_and_tokenizer,
    pick_device,
    result_name,
    sample_sentences,
    settings_of,
    timed,
    write_report,
)

# Helsinki-NLP/opus-mt-en-fr's config.json, the fields that shape the model.
OPUS_MT_EN_FR = dict(
    vocab_size=59514, d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
    decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, activation_function="swish",
    scale_embedding=True, max_position_embeddings=512, pad_token_id=59513, decoder_start_token_id=59513,
    eos_token_id=0, forced_eos_token_id=0, share_encoder_decoder_embeddings=True,
)
ENGINES = {
    "marian": "Marian (HF)",
    "vaswani": "Vaswani",
    "vaswani-lean": "Vaswani lean",
    "vaswani-int8-lean": "Vaswani int8 lean (--int8)",
}


def opus_mt_base(seed: int) -> MarianMTModel:
    torch.manual_seed(seed)
    model = MarianMTModel(MarianConfig(**OPUS_MT_EN_FR)).eval()
    pad = OPUS_MT_EN_FR["pad_token_id"]
    model.generation_config = GenerationConfig(
        bad_words_ids=[[pad]], bos_token_id=0, decoder_start_token_id=pad, eos_token_id=0, forced_eos_token_id=0,
        max_length=512, num_beams=4, pad_token_id=pad, renormalize_logits=True)
    return model


def build_engines(marian: MarianMTModel) -> dict:
    engines = {"marian": marian, "vaswani": from_marian(marian), "vaswani-lean": use_lean_decoding(from_marian(marian))}
    engines["vaswani-int8-lean"] = use_lean_decoding(quantize_for_cpu(from_marian(marian)))
    return engines


def batches_of(sentences, tokenizer, batch_size: int, pad: int):
    """Length-sorted batches of source ids (the BPE's, without its specials, then Marian's eos 0)."""
    sources = [tokenizer(s, add_special_tokens=False)["input_ids"] + [0] for s in sentences]
    sources.sort(key=len, reverse=True)
    batches = []
    for start in range(0, len(sources), batch_size):
        chunk = sources[start:start + batch_size]
        longest = max(map(len, chunk))
        input_ids = torch.tensor([ids + [pad] * (longest - len(ids)) for ids in chunk])
        batches.append({"input_ids": input_ids, "attention_mask": (input_ids != pad).long()})
    return batches


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
    batches = batches_of(sentences, tokenizer, args.batch_size, OPUS_MT_EN_FR["pad_token_id"])
    engines = build_engines(opus_mt_base(args.seed))

    rows = []
    for beams in [int(b) for b in args.beams.split(",")]:
        settings = {"num_beams": beams, "max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens}
        outputs = {name: [None] * len(batches) for name in engines}
        seconds = {name: [[] for _ in batches] for name in engines}
        with torch.inference_mode():
            for model in engines.values():  # warm-up: the longest batch, untimed
                model.generate(**batches[0], **settings)
            order = list(engines)
            for repeat in range(args.repeats):
                for index, batch in enumerate(batches):
                    order = order[1:] + order[:1]  # rotate, so that load changes hit every engine alike
                    for name in order:
                        output, elapsed = timed(device, lambda: engines[name].generate(**batch, **settings))
                        seconds[name][index].append(elapsed)
                        if outputs[name][index] is None:
                            outputs[name][index] = output
                        elif not torch.equal(outputs[name][index], output):
                            raise AssertionError(f"{name} is not deterministic")
        reference = [row for batch in outputs["marian"] for row in batch.tolist()]
        marian_seconds = sum(statistics.median(times) for times in seconds["marian"])
        for name in engines:
            produced = [row for batch in outputs[name] for row in batch.tolist()]
            assert all(len(row) == args.new_tokens + 1 for row in produced), f"{name}: not {args.new_tokens} tokens"
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
        f"from the project's joint BPE ({len(tokenizer)} tokens) plus Marian's eos; batches sorted by length, the "
        "same for every engine.",
        "Random weights in the shape of Helsinki-NLP/opus-mt-en-fr (no trained OPUS-MT model is reachable "
        "offline); the Vaswani engines are `vaswani.convert.from_marian` of that same Marian model.",
        f"Every output is exactly {args.new_tokens} new tokens (min_new_tokens = max_new_tokens; Marian's "
        "generation config, copied by the conversion, forces eos at the last one); outputs are compared token for "
        "token with Marian's. Marian's logits processors (bad_words_ids=[[pad]], forced eos) run in every engine.",
        "Vaswani = generate() of the converted model; lean = vaswani.decoding.use_lean_decoding; int8 lean = "
        "quantize_for_cpu + lean decoding, the scripts' --int8 path (int8 weights, so its outputs may differ).",
        f"Engines in one process, interleaved batch by batch in rotating order after one untimed warm-up batch; "
        f"seconds = sum over batches of the median of {args.repeats} repeats. Shared machine: load average "
        f"{' '.join(load)} at the end (1, 5, 15 min).",
    ]
    if args.notes:
        notes.append(args.notes)
    write_report(result_name(args, "convert-marian", device), "Converted OPUS-MT-base vs MarianMTModel",
                 command_line(__file__, argv), device, settings_of(args), rows, columns, notes, args.results_dir)


if __name__ == "__main__":
    main()
