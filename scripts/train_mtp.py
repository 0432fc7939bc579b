"""Train the multi-token-prediction (MTP) layers of a HybridIndexPool model, everything else frozen, on local text or
JSON files with `transformers.Trainer` (MTP loss alone).

A model without MTP layers gets fresh ones (`--num_mtp_layers N`, of `--mtp_type`, default Qwen4-Exp's kind for a
model with its residual streams, else DeepSeek's); a model with MTP layers trains its own, e.g. to realign them with
a fine-tuned model (`--reinitialize_mtp` starts them afresh). Each logging step (default every step) logs `mtp_loss`
and `mtp_accuracy_k`, the top-1 accuracy of depth `k`: the rate at which greedy decoding accepts its drafts. The
result is saved with `save_pretrained` (weights, config with the MTP layers, remote code, model card) plus the
tokenizer and the checkpoint's processor files; the exports to GLM-5.3-Flash and Qwen4-Exp write the head out in the
source's format. Every `TrainingArguments` option is accepted. Example:

    python -m hybrid_indexpool.scripts.train_mtp --model_name_or_path ckpt --train_files data.txt \\
        --num_mtp_layers 1 --block_size 2048 --output_dir ckpt-mtp --max_steps 2000 --learning_rate 1e-3
"""

from transformers import TrainingArguments

from hybrid_indexpool.mtp_training import MTPTrainingArguments, run_mtp_training
from hybrid_indexpool.training import parse_training_command_line, run_training_command


def parse_arguments(argv=None) -> tuple[MTPTrainingArguments, TrainingArguments]:
    """Parse the command line (or a single .json file of arguments)."""
    return parse_training_command_line(MTPTrainingArguments, argv, description=__doc__,
                                       default_options=[("--logging_steps", "1")])


def main(argv=None) -> dict:
    args, training_args = parse_arguments(argv)
    return run_training_command(run_mtp_training, args, training_args)


if __name__ == "__main__":
    main()
