"""One process of test_data's two-process run: prepares the data as `train_translation.py` does, then writes
what this process did (the data module's log), its tokenizer files and the batches it gets in two epochs, bucketed
and packed."""

import json
import logging
import sys
from pathlib import Path

from transformers import DataCollatorForSeq2Seq, HfArgumentParser

from vaswani import training
from vaswani.peers import end_process_group


def main() -> None:
    output = Path(sys.argv[1])
    parser = HfArgumentParser((training.ModelArguments, training.DataArguments, training.VaswaniTrainingArguments))
    model_args, data_args, args = parser.parse_args_into_dataclasses(args=sys.argv[2:])
    messages = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("vaswani").addHandler(handler)
    logging.getLogger("vaswani").setLevel(logging.INFO)

    data = training.prepare_data(model_args, data_args, args)
    model, tokenizer = training.build_model_and_tokenizer(model_args, data.tokenizer)
    train_features, _ = training.tokenize_splits(data, tokenizer, data_args, args)
    epochs = {}  # the batches of two epochs, by batching: the data once, then a trainer for each
    for batching, packing in (("bucketed", False), ("packed", True)):
        trainer = training.VaswaniSeq2SeqTrainer(
            model=model, args=args, train_dataset=train_features, processing_class=tokenizer,
            data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
            max_tokens_per_batch=args.max_tokens_per_batch, packing=packing)
        loader = trainer.get_train_dataloader()
        epochs[batching] = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            epochs[batching].append(list(loader.batch_sampler))

    rank = args.process_index
    tokenizer.save_pretrained(output / f"tokenizer-{rank}")
    record = {"messages": messages, "epochs": epochs, "train_examples": len(train_features),
              "max_tokens": args.max_tokens_per_batch}
    (output / f"rank-{rank}.json").write_text(json.dumps(record))
    end_process_group(completed=True)


if __name__ == "__main__":
    main()
