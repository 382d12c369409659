#!/usr/bin/env python
"""difftrainer: one entry point for the desktop GUI (no arguments) and the CLI.

  python launch.py                      the desktop GUI (ui/app.py)
  python launch.py train --config my.json [--preset NAME] [--set key=value ...] [--resume] [--gpus N] [--protocol jsonl]
  python launch.py cache --config my.json [--preset NAME] [--set key=value ...]
  python launch.py demo [--workspace DIR]
  python launch.py presets [list] | presets show NAME | presets save NAME [--preset P] [--config FILE]
  python launch.py schema
  python launch.py make-tiny-model --family sd15 --out DIR [--variant dev]
  python launch.py info [--json] [--device DEV]
  python launch.py caption --folder DIR --model PATH [--mode skip-existing|overwrite|append] [--prompt TEXT] [--protocol jsonl]
  python launch.py mask --folder DIR --model PATH --prompt TEXT [--threshold 0.4] [--protocol jsonl]
  python launch.py download-model OWNER/NAME [--list] [--yes] [--to DIR] [--protocol jsonl]
  python launch.py plan --config my.json [--preset NAME] [--set key=value ...] [--vram 16GiB] [--ram 64GiB] [--gpu CLASS] [--json]
  python launch.py remote --host user@box --config my.json | remote --attach --config my.json

An error that is the input's or the machine's (a bad config value, a missing or damaged file, a
full disk, a read-only folder) prints one `error:` line and exits 1; `--debug` (before or after
the subcommand) adds the traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# Nothing is ever downloaded unasked: model folders are local, and the hub libraries must not try
# (download-model, the one command that fetches, lifts this for its own request: autolabel/hub_download.py).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def default_cuda_allocator(environ=os.environ) -> None:
    """CUDA's caching allocator with expandable segments, unless the user configured it: a training
    step allocates activations of many sizes, and fixed segments leave free memory cut into pieces
    too small for the next large one (an out-of-memory error with gigabytes "reserved but
    unallocated"). Read when CUDA starts, so it is set here, before torch is imported. A setting of
    the user's under either name (PYTORCH_ALLOC_CONF is torch's newer one) is left as it is."""
    if "PYTORCH_ALLOC_CONF" not in environ and "PYTORCH_CUDA_ALLOC_CONF" not in environ:
        environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


default_cuda_allocator()

from modules.util.library_logs import quiet_library_logs  # noqa: E402  (after the environment above)

quiet_library_logs()


EXIT_BROKEN_PIPE = 141  # what a shell reports for a command whose reader went away (128 + SIGPIPE)


def user_error(error: BaseException):
    """The UserError an exception is for the user (an input or machine problem), or None (a bug)."""
    from modules.errors import environment_error

    return environment_error(error)


def report_user_error(error: BaseException, debug: bool, show) -> None:
    """Show a user error as one message (via `show`); with --debug, the traceback first."""
    if debug:
        import traceback

        traceback.print_exception(error, file=sys.stderr)
    show(str(user_error(error) or error))


def _usage_error(message: str):
    from modules.config.errors import ConfigError

    return ConfigError([message])


def cmd_train(args) -> int:
    from modules.cli.console import ConsoleCallbacks
    from modules.cli.multi_process import OtherRankCallbacks, process_rank, run_under_torchrun, under_torchrun
    from modules.cli.train_command import (
        install_stop_signals,
        resolve_config,
        run_training,
    )
    from modules.trainer.callbacks import FanOut
    from modules.trainer.commands import TrainCommands
    from modules.trainer.event_protocol import JsonlEvents, read_commands

    commands = TrainCommands()
    console = ConsoleCallbacks()
    events = None
    if under_torchrun() and process_rank() > 0:  # rank 0 reports and reads the commands (multi_process.py)
        callbacks = OtherRankCallbacks(process_rank())
    elif args.protocol == "jsonl":
        events = JsonlEvents(sys.stdout)
        callbacks = FanOut(events, console)
    else:
        callbacks = console
    try:
        if not args.config and not args.preset:
            raise _usage_error("train needs --config FILE or --preset NAME")
        gpus = ["distributed.gpus=" + str(args.gpus)] if args.gpus else []
        config = resolve_config(args.config, args.preset, args.set + gpus, args.resume)
        if config.distributed.gpus > 1 and not under_torchrun():
            return run_under_torchrun(config.distributed.gpus, args.argv)  # (stdin left for rank 0 to read)
        if events is not None:
            read_commands(sys.stdin, commands, events)
        install_stop_signals(commands)
        path = run_training(config, callbacks, commands)
    except Exception as error:  # noqa: BLE001  (a user error becomes an error event; a bug is re-raised)
        if user_error(error) is None:
            raise
        report_user_error(error, args.debug, callbacks.on_error)
        return 1
    finally:
        from modules.trainer.distributed import leave_process_group

        leave_process_group()  # (a torchrun rank; nothing in a one-process run)
    if args.protocol != "jsonl" and path is not None:  # None: stopped before the first step, nothing saved
        print(path)
    return 0


def cmd_cache(args) -> int:
    from modules.cli.cache_command import build_caches
    from modules.cli.console import ConsoleCallbacks
    from modules.cli.stop_signals import EXIT_INTERRUPTED, install_stop_signals
    from modules.cli.train_command import resolve_config
    from modules.trainer.commands import TrainCommands

    if not args.config and not args.preset:
        raise _usage_error("cache needs --config FILE or --preset NAME")
    config = resolve_config(args.config, args.preset, args.set)
    commands = TrainCommands()
    install_stop_signals(commands, doing="stopping after the batch being encoded; what is written stays")
    try:
        report = build_caches(config, ConsoleCallbacks(), commands)
    except KeyboardInterrupt:  # the second signal: entries are written whole or not at all (atomic writes)
        print("error: interrupted; the cache entries written so far stay", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(report.summary())
    return 0


def cmd_demo(args) -> int:
    from modules.cli.console import ConsoleCallbacks
    from modules.cli.demo import prepare_demo
    from modules.cli.train_command import install_stop_signals, run_training
    from modules.trainer.commands import TrainCommands

    print(f"[demo: preparing a tiny model and images in {args.workspace}]", file=sys.stderr)
    config = prepare_demo(args.workspace, args.set)
    commands = TrainCommands()
    install_stop_signals(commands)
    path = run_training(config, ConsoleCallbacks(), commands)
    if path is None:  # stopped before its first step
        return 0
    print(f"demo LoRA written to {path}")
    print(f"samples in {os.path.join(config.workspace_dir, 'samples')}")
    return 0


def cmd_presets(args) -> int:
    from modules.config.loading import build_config, read_json_file
    from modules.config.presets import list_presets, load_preset_overlay, save_preset

    if args.action in (None, "list"):
        for preset in list_presets():
            origin = "built-in" if preset.builtin else "user"
            print(f"{preset.name:28s} {preset.family or '?':8s} {origin:9s} {preset.path}")
    elif args.action == "show":
        if not args.name:
            print("error: presets show needs a NAME", file=sys.stderr)
            return 2
        config = build_config([load_preset_overlay(args.name)], args.set)
        print(config.model_dump_json(indent=2))
    elif args.action == "save":
        if not args.name or not (args.config or args.preset):
            print("error: presets save needs NAME and --config FILE and/or --preset NAME", file=sys.stderr)
            return 2
        layers = [load_preset_overlay(args.preset)] if args.preset else []  # under the config files, as in train
        config = build_config(layers + [read_json_file(path) for path in args.config], args.set)
        print(save_preset(config, args.name))
    return 0


def cmd_schema(_args) -> int:
    from modules.config.train_config import TrainConfig

    print(json.dumps(TrainConfig.model_json_schema(), indent=2))
    return 0


def cmd_make_tiny_model(args) -> int:
    from modules.config.families import family_names, get_family_class
    from modules.util.did_you_mean import did_you_mean

    if args.family not in family_names():
        print(f"error: --family: unknown family {args.family!r}{did_you_mean(args.family, family_names())} "
              f"(known: {', '.join(family_names())})", file=sys.stderr)
        return 2
    family = get_family_class(args.family)
    if args.variant is None:
        print(family.make_tiny_model(args.out))
        return 0
    if args.variant not in family.tiny_model_variants:
        known = ", ".join(family.tiny_model_variants) or "none"
        print(f"error: --variant: {args.family} has no variant {args.variant!r} (its variants: {known})", file=sys.stderr)
        return 2
    print(family.make_tiny_model(args.out, variant=args.variant))
    return 0


def cmd_plan(args) -> int:
    from modules.util.planning_imports import import_model_libraries_for_planning

    import_model_libraries_for_planning()  # first: a process that only plans (modules/util/planning_imports.py)
    from modules.cli.plan_command import format_plan, run_plan_command
    from modules.cli.train_command import resolve_config

    config = resolve_config(args.config, args.preset, args.set)  # neither: the defaults and --set
    variant = None
    if args.preset and not config.model.base:  # the released model the preset is made for
        from modules.config.families import get_family_class

        variant = get_family_class(config.model.family).released_variant(args.preset)
    plan = run_plan_command(config, args.vram, args.ram, args.gpu, variant)
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return 0


def cmd_info(args) -> int:
    from modules.cli.info import format_info, machine_info

    try:
        info = machine_info(args.device)
    except ValueError as error:  # an unusable --device
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def cmd_caption(args) -> int:
    from modules.cli.label_command import caption_command

    return caption_command(args)


def cmd_mask(args) -> int:
    from modules.cli.label_command import mask_command

    return mask_command(args)


def cmd_download_model(args) -> int:
    from modules.cli.download_command import download_command

    return download_command(args)


def cmd_remote(args) -> int:
    from modules.remote.cli import cmd_remote as run_remote

    return run_remote(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="launch.py", description="difftrainer: train LoRA adapters for diffusion models")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error, not only its message")
    sub = parser.add_subparsers(dest="command")

    train = sub.add_parser("train", help="train headless from a config file and/or preset")
    train.add_argument("--config", action="append", default=[], metavar="FILE", help="config JSON (repeatable; later wins)")
    train.add_argument("--preset", help="a preset name, applied under the config files")
    train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. schedule.epochs=5")
    train.add_argument("--resume", action="store_true", help="continue from the newest backup in the workspace")
    train.add_argument("--gpus", type=int, metavar="N", help="train on N GPUs of this machine (one process each, "
                       "through torchrun); the same as --set distributed.gpus=N")
    train.add_argument("--protocol", choices=["text", "jsonl"], default="text",
                       help="jsonl: one JSON event per line on stdout, JSON commands on stdin (see docs/run-protocol.md)")
    train.set_defaults(run=cmd_train)

    cache = sub.add_parser("cache", help="fill the latent and text caches of a config without training "
                           "(resumable; a following train encodes nothing)")
    cache.add_argument("--config", action="append", default=[], metavar="FILE", help="config JSON (repeatable; later wins)")
    cache.add_argument("--preset", help="a preset name, applied under the config files")
    cache.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. data.resolution=768")
    cache.set_defaults(run=cmd_cache)

    demo = sub.add_parser("demo", help="train a tiny LoRA on a tiny model, offline, in about a minute on a CPU")
    demo.add_argument("--workspace", default="workspace/demo", metavar="DIR",
                      help="where the tiny model, its images and the run go (default: workspace/demo)")
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override the demo's config, e.g. schedule.max_steps=10")
    demo.set_defaults(run=cmd_demo)

    presets = sub.add_parser("presets", help="list, show or save presets")
    presets.add_argument("action", nargs="?", choices=["list", "show", "save"],
                         help="list (the default): every preset; show NAME: it merged onto the defaults, as JSON; "
                              "save NAME: a user preset")
    presets.add_argument("name", nargs="?", help="the preset to show or save")
    presets.add_argument("--config", action="append", default=[], metavar="FILE",
                         help="save: config JSON to put on top (repeatable; later wins)")
    presets.add_argument("--preset", help="save: start from this preset (the config files and --set go on top)")
    presets.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                         help="show, save: override, e.g. schedule.epochs=5")
    presets.set_defaults(run=cmd_presets)

    sub.add_parser("schema", help="print the config's JSON Schema").set_defaults(run=cmd_schema)

    tiny = sub.add_parser("make-tiny-model", help="write a tiny random model of a family, offline")
    tiny.add_argument("--family", default="sd15",
                      help="the model.family to build (default sd15; `launch.py info` lists the families)")
    tiny.add_argument("--out", required=True, metavar="DIR", help="the folder to write the diffusers model into")
    tiny.add_argument("--variant", help="a model of a family of several: flux2's 'klein' (default) or "
                      "'dev'; qwen_image_edit_plus's '2509' (default) or '2511'; wan_i2v's 'i2v' (default) or "
                      "'flf2v' (Wan 2.1 FLF2V)")
    tiny.set_defaults(run=cmd_make_tiny_model)

    info = sub.add_parser("info", help="families, presets, devices, and the weight dtypes that work here")
    info.add_argument("--json", action="store_true", help="print JSON instead of text (for the GUI and scripts)")
    info.add_argument("--device", default="auto",
                      help="the train device to probe and size auto precision for (default: auto, as in training)")
    info.set_defaults(run=cmd_info)

    from modules.cli.label_arguments import add_caption_parser, add_download_parser, add_mask_parser

    add_caption_parser(sub).set_defaults(run=cmd_caption)
    add_mask_parser(sub).set_defaults(run=cmd_mask)
    add_download_parser(sub).set_defaults(run=cmd_download_model)
    plan = sub.add_parser("plan", help="what a config needs on the train device and the host, per part, "
                          "and whether it fits (before anything loads)")
    plan.add_argument("--config", action="append", default=[], metavar="FILE", help="config JSON (repeatable; later wins)")
    plan.add_argument("--preset", help="a preset name, applied under the config files")
    plan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. schedule.batch_size=2")
    plan.add_argument("--vram", metavar="SIZE", help="train-device memory to plan for (16GiB, 12GB, 24000MB); "
                      "default: the train device's free memory")
    plan.add_argument("--ram", metavar="SIZE", help="host memory to plan for; default: the host's available RAM")
    plan.add_argument("--gpu", metavar="CLASS", help="the GPU class seconds per step are estimated for "
                      "(rtx3060, rtx3090, rtx4060ti-16, rtx4070, rtx4080, rtx4090, rtx5090, a100-80g, h100-sxm; "
                      "default rtx4090)")
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    plan.set_defaults(run=cmd_plan)

    from modules.remote.cli import add_remote_parser

    add_remote_parser(sub).set_defaults(run=cmd_remote)
    # `--debug` after the subcommand too; SUPPRESS keeps a subcommand from resetting one given before it
    for subparser in sub.choices.values():
        subparser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                               help="show the traceback of an error, not only its message")
    return parser


def start_gui() -> int:
    """`launch.py` with no arguments: the desktop GUI, or a clear message where it cannot open."""
    from ui import display_available

    if not display_available():
        print("error: no display for the desktop GUI (DISPLAY is not set). To train headless, run\n"
              "  python launch.py train --config my.json [--preset NAME]\n"
              "(see `python launch.py --help`), or start the GUI on a machine with a display.", file=sys.stderr)
        return 1
    try:
        from ui.app import main as gui_main
    except ImportError as error:  # tkinter or customtkinter missing
        print(f"error: the desktop GUI cannot start: {error}\n"
              "  install python3-tk and `pip install -r requirements.txt`, or train headless with "
              "`python launch.py train --config my.json`.", file=sys.stderr)
        return 1
    return gui_main()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        return start_gui()
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv)  # what a multi-GPU train passes on to torchrun
    if not getattr(args, "run", None):
        parser.print_help()
        return 0
    try:
        return args.run(args)
    except BrokenPipeError:
        # `launch.py presets show X | head`: the reader has all it wanted. Point stdout at devnull so
        # the interpreter's final flush does not raise again, and end quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as error:  # noqa: BLE001  (a user error is one line; a bug is re-raised with its traceback)
        if user_error(error) is None:
            raise
        report_user_error(error, args.debug, lambda message: print(f"error: {message}", file=sys.stderr))
        return 1


if __name__ == "__main__":
    sys.exit(main())
