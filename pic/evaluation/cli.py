"""``pic eval fidelity`` and ``pic eval accuracy``: their arguments, and running them on a loaded engine.

Parsing imports nothing heavy (``pic --version`` stays fast); ``run`` imports the evaluation itself.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from pic.cli_args import cases, file_stem, non_negative_int, positive_int

# Where `pic eval` writes unless told: a folder of the user's, never the repository's results.
DEFAULT_EVAL_DIR = "pic-eval"
_ADD_BOS = {"auto": None, "on": True, "off": False}


def add_parser(
    commands: argparse._SubParsersAction,
    model_options: Callable[[argparse.ArgumentParser], None],
) -> None:
    evaluate = commands.add_parser("eval", help="evaluate recompute policies")
    evaluations = evaluate.add_subparsers(dest="evaluation", required=True)
    fidelity = evaluations.add_parser(
        "fidelity", help="KL to Full Recompute, top-1 agreement, NLL, recomputed tokens and link time per policy"
    )
    fidelity.add_argument(
        "--workload", default=None, help='JSONL of {"chunks": [...], "query": ...} (default: sampled)'
    )
    fidelity.add_argument("--cases", type=cases, default=30, help="cases to sample (default workload only)")
    fidelity.add_argument("--seed", type=non_negative_int, default=0, help="sampling seed (default workload only)")
    accuracy = evaluations.add_parser(
        "accuracy", help="multi-document QA accuracy per policy, beside fidelity, cost and attention sinks"
    )
    accuracy.add_argument(
        "--workload", choices=("qa", "profiles"), default="qa",
        help="qa: 4 short documents of filler and planted facts (default); profiles: 3 paragraphs of 150-500 "
        "tokens about people, competing facts of the same form",
    )  # fmt: skip
    accuracy.add_argument("--cases", type=cases, default=200, help="questions (default 200)")
    accuracy.add_argument(
        "--documents", type=positive_int, default=None, help="documents per question (default: 4 qa, 3 profiles)"
    )
    accuracy.add_argument("--sentences", type=positive_int, default=5, help="qa: filler sentences per document (5)")
    accuracy.add_argument("--two-docs-share", type=float, default=0.2, help="qa: share of two-document questions (0.2)")
    accuracy.add_argument(
        "--question-after-only", action="store_true", help="ask the question after the documents only, not before too"
    )
    accuracy.add_argument("--seed", type=non_negative_int, default=0, help="workload seed (default 0)")
    accuracy.add_argument("--max-new-tokens", type=positive_int, default=24, help="longest reply (default 24)")
    accuracy.add_argument(
        "--sink-cases", type=non_negative_int, default=20, help="cases for the attention-sink profile (default 20)"
    )
    for parser, name in ((fidelity, "fidelity"), (accuracy, "accuracy")):
        model_options(parser)
        parser.add_argument(
            "--add-bos", choices=list(_ADD_BOS), default="auto",
            help="compile chunks after a BOS token: auto (when the tokenizer writes one), on or off",
        )  # fmt: skip
        parser.add_argument(
            "--policies", default=None,
            help="policy specs separated by spaces (default: all families); for accuracy, SPEC@context links "
            "chunks compiled in the chat's context",
        )  # fmt: skip
        parser.add_argument(
            "--out",
            default=DEFAULT_EVAL_DIR,
            help=f"folder for <name>.json and <name>.png (default: ./{DEFAULT_EVAL_DIR})",
        )
        parser.add_argument("--name", type=file_stem, default=name, help=f"file name stem (default: {name})")


def engine_options(args: argparse.Namespace) -> dict[str, object]:
    """``PIC.from_pretrained`` options the evaluation's arguments set."""
    from pic.config import PICConfig

    return {"config": PICConfig(add_bos=_ADD_BOS[args.add_bos])}


def run(args: argparse.Namespace, load: Callable[[], object]) -> int:
    """Run the evaluation ``args`` names on the engine ``load()`` returns (after checking the workload's
    arguments, so a bad one fails before the model loads); returns the exit code."""
    from pic.evaluation import ACCURACY_POLICIES, DEFAULT_POLICIES
    from pic.evaluation.command import run_accuracy, run_fidelity

    defaults = DEFAULT_POLICIES if args.evaluation == "fidelity" else ACCURACY_POLICIES
    policies = args.policies.split() if args.policies else defaults
    if args.evaluation == "fidelity":
        run_fidelity(
            load(), workload=args.workload, num_cases=args.cases, seed=args.seed, policies=policies,
            out_dir=args.out, name=args.name,
        )  # fmt: skip
        return 0
    from pic.evaluation.profiles import profile_workload
    from pic.evaluation.qa import qa_workload

    if args.workload == "profiles":
        workload = profile_workload(
            num_cases=args.cases, num_documents=args.documents or 3, question_first=not args.question_after_only,
            seed=args.seed,
        )  # fmt: skip
    else:
        workload = qa_workload(
            num_cases=args.cases, num_documents=args.documents or 4, sentences_per_document=args.sentences,
            two_docs_share=args.two_docs_share, question_first=not args.question_after_only, seed=args.seed,
        )  # fmt: skip
    run_accuracy(
        load(), workload=workload, policies=policies, max_new_tokens=args.max_new_tokens,
        num_sink_cases=args.sink_cases, out_dir=args.out, name=args.name,
    )  # fmt: skip
    return 0
