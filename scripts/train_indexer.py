"""Train the indexer of a HybridIndexPool model in two stages (DeepSeek-V3.2's recipe) with
`transformers.Trainer` on local text or JSON files.

Stage 1, dense warm-up (`--stage warmup`): only the indexer and pooling parameters train, on the KL divergence between
their window scores and the dense attention. Stage 2, sparse training (`--stage sparse`): every parameter trains on
the language-model loss plus `indexer_loss_weight` times the KL over the selected windows. `--stage both` runs one
after the other; `--freeze_pooling` keeps the learned pooling weights as they are in both stages (a model converted
from Qwen4-Exp then still exports back to it). The KL is logged as `indexer_kl` every `--logging_steps` (default 1).
Works on a saved checkpoint (`--model_name_or_path`, e.g. a converted one, multimodal ones included: they train on
text and keep their vision tower) or a new model (`--init_config`); the result is saved with `save_pretrained`
(weights, config, remote code, model card) plus the tokenizer and the checkpoint's processor files. Every
`TrainingArguments` option is accepted except `--max_steps` (each stage has its own step count). Example:

    python -m hybrid_indexpool.scripts.train_indexer --model_name_or_path ckpt --train_files data.txt \\
        --block_size 8192 --output_dir out --stage both --dense_warmup_steps 1000 --sparse_steps 1000 \\
        --dense_warmup_learning_rate 1e-3 --learning_rate 7e-6 --per_device_train_batch_size 4
"""

from transformers import TrainingArguments

from hybrid_indexpool.indexer_training import IndexerTrainingArguments, run_indexer_training
from hybrid_indexpool.training import parse_training_command_line, run_training_command


def parse_arguments(argv=None) -> tuple[IndexerTrainingArguments, TrainingArguments]:
    """Parse the command line (or a single .json file of arguments)."""
    # Log every step by default: the KL of each step shows the warm-up's progress.
    return parse_training_command_line(
        IndexerTrainingArguments, argv, description=__doc__, default_options=[("--logging_steps", "1")]
    )


def main(argv=None) -> dict:
    args, training_args = parse_arguments(argv)
    return run_training_command(run_indexer_training, args, training_args)


if __name__ == "__main__":
    main()
