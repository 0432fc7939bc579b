"""Fine-tune a HybridIndexPool model (causal LM) with `transformers.Trainer` on local text or JSON files.

Every `TrainingArguments` option is accepted (`--learning_rate`, `--max_steps`, `--bf16`, `--gradient_checkpointing`,
`--resume_from_checkpoint`, `--save_steps`, ...). Examples:

    python -m hybrid_indexpool.scripts.finetune --model_name_or_path ckpt --train_files data.txt \\
        --output_dir out --max_steps 100 --per_device_train_batch_size 4 --gradient_checkpointing

The same on 2 processes with DDP (gloo on CPU, NCCL on GPUs):

    accelerate launch --multi_gpu --num_processes 2 -m hybrid_indexpool.scripts.finetune \\
        --model_name_or_path ckpt --train_files data.txt --output_dir out --max_steps 100
"""

from transformers import TrainingArguments

from hybrid_indexpool.training import FinetuneArguments, parse_training_command_line, run_finetune, run_training_command


def parse_arguments(argv=None) -> tuple[FinetuneArguments, TrainingArguments]:
    """Parse the command line (or a single .json file of arguments)."""
    return parse_training_command_line(FinetuneArguments, argv, description=__doc__)


def main(argv=None) -> dict:
    args, training_args = parse_arguments(argv)
    return run_training_command(run_finetune, args, training_args)


if __name__ == "__main__":
    main()
