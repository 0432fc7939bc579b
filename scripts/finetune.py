"""Fine-tune a HybridIndexPool model (causal LM) with `transformers.Trainer` on local text or JSON files.

Every `TrainingArguments` option is accepted (`--learning_rate`, `--max_steps`, `--bf16`, `--gradient_checkpointing`,
`--resume_from_checkpoint`, `--save_steps`, ...). Examples:

    python -m hybrid_indexpool.scripts.finetune --model_name_or_path ckpt --train_files data.txt \\
        --output_dir out --max_steps 100 --per_device_train_batch_size 4 --gradient_checkpointing
    accelerate launch --multi_gpu --num_processes 2 -m hybrid_indexpool.scripts.finetune ...   # 2 processes, DDP
                                                                           # (gloo on CPU, NCCL on GPUs)
"""

import sys

import torch
from transformers import HfArgumentParser, TrainingArguments

from hybrid_indexpool.training import FinetuneArguments, run_finetune


def parse_arguments(argv=None) -> tuple[FinetuneArguments, TrainingArguments]:
    """Parse the command line (or a single .json file of arguments)."""
    parser = HfArgumentParser((FinetuneArguments, TrainingArguments), description=__doc__)
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(argv[0])
    if not torch.cuda.is_available() and "--use_cpu" not in argv:
        # Without it the Trainer ignores a CPU launch by `accelerate launch` (each process would train alone).
        argv.append("--use_cpu")
    args, training_args = parser.parse_args_into_dataclasses(args=argv)
    if training_args.bf16 is False and "--bf16" not in argv and torch.cuda.is_available() \
            and torch.cuda.is_bf16_supported():
        training_args.bf16 = True  # bf16 by default where the hardware supports it
    return args, training_args


def main(argv=None) -> dict:
    args, training_args = parse_arguments(argv)
    return run_finetune(args, training_args)


if __name__ == "__main__":
    main()
