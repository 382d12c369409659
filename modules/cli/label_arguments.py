"""The command-line arguments of `launch.py caption`, `mask` and `download-model`, apart from their
code: launch.py builds its parser (for every subcommand, `plan` too) from argparse alone, without
importing the labelling commands and what they import (the trainer's event protocol, stop signals)."""

from __future__ import annotations


def add_label_arguments(parser) -> None:
    parser.add_argument("--folder", required=True, help="the folder of images (a concept's path)")
    parser.add_argument("--model", required=True, metavar="PATH", help="a local model folder: transformers layout, or a WD14 tagger (model.onnx, selected_tags.csv); or a hub id fetched with download-model")
    parser.add_argument("--include-subfolders", action="store_true", help="the images of its subfolders too")
    parser.add_argument("--batch-size", type=int, default=4, help="images per batch (default 4)")
    parser.add_argument("--device", default="auto", help="torch device (default: auto, cuda where there is one)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                        help="model dtype (default: auto, float32 on the CPU, bfloat16/float16 on CUDA)")
    parser.add_argument("--protocol", choices=["text", "jsonl"], default="text",
                        help="jsonl: JSON events on stdout, {\"command\": \"stop\"} on stdin (docs/run-protocol.md)")


def add_caption_parser(sub):
    from modules.autolabel.caption_folder import MODES

    caption = sub.add_parser("caption", help="write a caption .txt beside each image with an image-to-text model "
                             "(BLIP, or a chat VLM such as Qwen2-VL or LLaVA)")
    add_label_arguments(caption)
    caption.add_argument("--mode", choices=MODES, default="skip-existing",
                         help="overwrite | append (after the caption there) | skip-existing (default)")
    caption.add_argument("--prompt", help="prompt template; {name}: the file name, {caption}: its caption now "
                         "(default: none for BLIP, 'Describe this image in one sentence.' for a chat model)")
    caption.add_argument("--max-new-tokens", type=int, default=60, help="the longest caption, in tokens (default 60)")
    return caption


def add_mask_parser(sub):
    from modules.autolabel.mask_folder import MASK_MODES

    mask = sub.add_parser("mask", help="write a loss mask <image>-masklabel.png beside each image: what a text "
                          "prompt names (CLIPSeg) or the foreground (a background-removal model)")
    add_label_arguments(mask)
    mask.add_argument("--prompt", help="what to train on, e.g. 'a person' (white in the mask); CLIPSeg needs it, "
                      "background removal takes none")
    mask.add_argument("--threshold", type=float, default=0.4,
                      help="probability above which a pixel is white (default 0.4)")
    mask.add_argument("--expand", type=int, default=0, metavar="PX", help="grow the white area by PX pixels")
    mask.add_argument("--mode", choices=MASK_MODES, default="overwrite",
                      help="overwrite (default) | add (unite with the mask there) | skip-existing")
    return mask


def add_download_parser(sub):
    parser = sub.add_parser("download-model", help="fetch a captioning/tagging/masking model from the Hugging Face "
                            "hub into the user's models folder, after showing its files and size")
    parser.add_argument("repo_id", metavar="OWNER/NAME", help="the model's hub id, e.g. Salesforce/blip-image-captioning-base")
    parser.add_argument("--revision", help="a branch, tag or commit (default: main)")
    parser.add_argument("--to", metavar="DIR", help="the folder to put it under (default: the user's models folder)")
    parser.add_argument("--list", action="store_true", help="list the files and their size; download nothing")
    parser.add_argument("--yes", action="store_true", help="download without asking")
    parser.add_argument("--protocol", choices=["text", "jsonl"], default="text",
                        help="jsonl: JSON events on stdout, {\"command\": \"stop\"} on stdin (docs/run-protocol.md)")
    return parser
