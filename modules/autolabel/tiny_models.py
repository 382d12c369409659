"""Tiny random labelling models, built offline from transformers configs (for tests and trying the
tools without a download): BLIP, BLIP-2 and Florence-2 captioners, LLaVA, Qwen2-VL,
Qwen2.5-VL and Qwen3-VL chat captioners and a CLIPSeg masker, each a folder from_pretrained reads, with a
tokenizer built from a word list; and a WD14-layout tagger, an ONNX graph of known scores (its
tags: TINY_WD14_TAGS).

A random model's first choice is often a special token, which decodes to an empty caption; the
captioners' generation configs here forbid those (and ask for a few tokens at least) so that a
test sees a caption for every image. Real checkpoints keep their own generation configs."""

from __future__ import annotations

from pathlib import Path

WORDS = "a an the of red blue green yellow circle square triangle photo picture on with and".split()


def _seeded():
    import torch

    torch.manual_seed(0)


def _word_tokenizer(special: list[str], words: list[str], **tokens):
    """A fast tokenizer over whole words (split at white space), specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(special + ["[UNK]"] + words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", **tokens), vocab


def _no_special_starts(model, special_ids: list[int], eos: int | None) -> None:
    model.generation_config.suppress_tokens = [i for i in special_ids if i != eos]
    model.generation_config.min_new_tokens = 3


def make_tiny_blip(out: str | Path) -> Path:
    from transformers import BertTokenizer, BlipConfig, BlipForConditionalGeneration, BlipImageProcessor, BlipProcessor

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer = BertTokenizer(vocab={word: index for index, word in enumerate(special + WORDS)})
    processor = BlipProcessor(image_processor=BlipImageProcessor(size={"height": 32, "width": 32}), tokenizer=tokenizer)
    config = BlipConfig(
        text_config=dict(vocab_size=len(special) + len(WORDS), hidden_size=32, encoder_hidden_size=32,
                         intermediate_size=64, num_attention_heads=2, num_hidden_layers=2, max_position_embeddings=64,
                         bos_token_id=2, sep_token_id=3, pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=2,
                           image_size=32, patch_size=8),
        projection_dim=32, image_text_hidden_size=32)
    _seeded()
    model = BlipForConditionalGeneration(config)
    _no_special_starts(model, [0, 1, 2, 4], eos=3)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def make_tiny_blip2(out: str | Path) -> Path:
    """BLIP-2: a Q-Former between a tiny vision tower and a tiny OPT."""
    from transformers import Blip2Config, Blip2ForConditionalGeneration, Blip2Processor, BlipImageProcessor

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, _ = _word_tokenizer(["<pad>", "</s>"], WORDS, bos_token="</s>", eos_token="</s>", pad_token="<pad>")
    # the processor adds its image token to the tokenizer (one placeholder per query token)
    processor = Blip2Processor(image_processor=BlipImageProcessor(size={"height": 32, "width": 32}),
                               tokenizer=tokenizer, num_query_tokens=4)
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    config = Blip2Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_hidden_layers=2,
                           image_size=32, patch_size=8),
        qformer_config=dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, encoder_hidden_size=32, max_position_embeddings=64),
        text_config=dict(model_type="opt", vocab_size=len(tokenizer), hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                         num_attention_heads=2, word_embed_proj_dim=32, max_position_embeddings=128, bos_token_id=1,
                         eos_token_id=1, pad_token_id=0),
        num_query_tokens=4, image_token_index=image_token)
    _seeded()
    model = Blip2ForConditionalGeneration(config)
    # (without a prompt this tiny one ends its caption at once, whatever the generation config says:
    # tests caption with a prompt)
    _no_special_starts(model, [0, 2, image_token], eos=1)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() }}: "
    "{% if message['content'] is string %}{{ message['content'] }} {% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<image> {% elif item['type'] == 'text' %}{{ item['text'] }} {% endif %}"
    "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT: {% endif %}")


def make_tiny_llava(out: str | Path) -> Path:
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    special = ["<pad>", "<s>", "</s>", "<image>"]
    tokenizer, vocab = _word_tokenizer(special, ["USER:", "ASSISTANT:", "describe", "this", "image", "."] + WORDS,
                                       bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                       extra_special_tokens={"image_token": "<image>"})
    processor = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32},
                                                                  crop_size={"height": 32, "width": 32}),
                               tokenizer=tokenizer, chat_template=LLAVA_TEMPLATE, patch_size=8,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1)
    config = LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=32, patch_size=8, projection_dim=32),
        image_token_id=vocab["<image>"], vision_feature_layer=-1, vision_feature_select_strategy="default")
    _seeded()
    model = LlavaForConditionalGeneration(config)
    _no_special_starts(model, [vocab[token] for token in special + ["[UNK]", "USER:", "ASSISTANT:"]], eos=vocab["</s>"])
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


# ChatML with Qwen-VL's vision tokens, as the released Qwen2-VL / Qwen2.5-VL templates lay a user turn
# out (theirs also open with a default system message and can number images; neither matters here)
QWEN2_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tiny_qwen_vl(out: str | Path, config_class, model_class, vision_config: dict, **text_config) -> Path:
    """A Qwen-VL in a released checkpoint's layout: config.json and weights, preprocessor_config.json
    (Qwen2VLImageProcessor's settings, 8 px patches merged 2x2: a 48x40 image is 6 image tokens),
    the tokenizer's files and chat_template.jinja; no video processor config (the released Qwen2-VL
    folders have none either). Written part by part, as their processor classes cannot be built
    without torchvision (modules/autolabel/image_only_processor.py)."""
    from transformers import Qwen2VLImageProcessorPil

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
               "<|video_pad|>"]
    roles = ["system", "user", "assistant"]
    tokenizer, vocab = _word_tokenizer(special, roles + ["describe", "this", "image", "."] + WORDS,
                                       eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                       additional_special_tokens=special[1:])
    (out / "chat_template.jinja").write_text(QWEN2_VL_TEMPLATE, encoding="utf-8")
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(min_pixels=16 * 16, max_pixels=64 * 64, patch_size=8, merge_size=2,
                             temporal_patch_size=2).save_pretrained(out)
    config = config_class(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, bos_token_id=None,
                         eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"],
                         # multimodal rotary positions: (time, height, width) sections of the 8 frequencies
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                          **text_config.pop("rope_parameters", {})}, **text_config),
        vision_config=dict(depth=2, num_heads=2, patch_size=8, spatial_merge_size=2, temporal_patch_size=2,
                           **vision_config),
        image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"])
    _seeded()
    model = model_class(config)
    _no_special_starts(model, [vocab[token] for token in special + ["[UNK]"] + roles], eos=vocab["<|im_end|>"])
    model.save_pretrained(out)
    return out


def make_tiny_qwen2_vl(out: str | Path) -> Path:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    return _tiny_qwen_vl(out, Qwen2VLConfig, Qwen2VLForConditionalGeneration,
                         dict(embed_dim=16, hidden_size=32, mlp_ratio=2))  # hidden_size: the language model's


def make_tiny_qwen2_5_vl(out: str | Path) -> Path:
    """Qwen2.5-VL: its vision tower attends within windows (32 px: 2x2 merged patches) but in the blocks
    `fullatt_block_indexes` names."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    return _tiny_qwen_vl(out, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                         dict(hidden_size=16, intermediate_size=32, out_hidden_size=32, window_size=32,
                              fullatt_block_indexes=[1]))


def make_tiny_qwen3_vl(out: str | Path) -> Path:
    """Qwen3-VL: learned vision positions (a 4x4 grid, interpolated to the image's), the first vision
    block's features added to the language model's first layers (deepstack), interleaved rotary
    sections, as the released configs set them."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    return _tiny_qwen_vl(out, Qwen3VLConfig, Qwen3VLForConditionalGeneration,
                         dict(hidden_size=16, intermediate_size=32, out_hidden_size=32, num_position_embeddings=16,
                              deepstack_visual_indexes=[0]),
                         head_dim=16, rope_parameters={"mrope_interleaved": True})


def make_tiny_clipseg(out: str | Path) -> Path:
    from transformers import (
        CLIPSegConfig,
        CLIPSegForImageSegmentation,
        CLIPSegProcessor,
        CLIPTokenizer,
        ViTImageProcessor,
    )

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # byte-pair merges are optional: without any, a word is its letters (each a token)
    letters = sorted(set("".join(WORDS + ["person", "background"])))
    tokens = ["<|startoftext|>", "<|endoftext|>"] + letters + [letter + "</w>" for letter in letters]
    tokenizer = CLIPTokenizer(vocab={token: index for index, token in enumerate(tokens)}, merges=[])
    processor = CLIPSegProcessor(image_processor=ViTImageProcessor(size={"height": 32, "width": 32}), tokenizer=tokenizer)
    config = CLIPSegConfig(
        text_config=dict(vocab_size=len(tokens), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        projection_dim=32, reduce_dim=16, extract_layers=[0, 1], decoder_num_attention_heads=2,
        decoder_intermediate_size=32)
    _seeded()
    CLIPSegForImageSegmentation(config).save_pretrained(out)
    processor.save_pretrained(out)
    return out


def make_tiny_florence2(out: str | Path) -> Path:
    """A Florence-2 of two DaViT stages and one BART layer each way, at 32 px: 17 image tokens (the
    4x4 patches of the last stage and their pooled token), which the processor's image_seq_length
    must equal."""
    from transformers import CLIPImageProcessorPil, Florence2Config, Florence2ForConditionalGeneration, Florence2Processor

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    special = ["<pad>", "<s>", "</s>", "<image>"]
    prompt_words = "what does image describe? describe in detail is shown with paragraph .".split()
    tokenizer, vocab = _word_tokenizer(special, list(dict.fromkeys(prompt_words + WORDS)), bos_token="<s>",
                                       eos_token="</s>", pad_token="<pad>", extra_special_tokens={"image_token": "<image>"})
    image_processor = CLIPImageProcessorPil(size={"height": 32, "width": 32}, do_center_crop=False)
    image_processor.image_seq_length = 17
    processor = Florence2Processor(image_processor=image_processor, tokenizer=tokenizer)
    config = Florence2Config(
        vision_config=dict(depths=[1, 1], patch_size=[7, 3], patch_stride=[4, 2], patch_padding=[3, 1],
                           patch_prenorm=[False, True], embed_dim=[8, 16], num_heads=[1, 2], num_groups=[1, 2],
                           window_size=2, projection_dim=16, drop_path_rate=0.0, max_temporal_embeddings=1,
                           max_position_embeddings=8),
        text_config=dict(vocab_size=len(vocab), d_model=16, encoder_layers=1, decoder_layers=1,
                         encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                         max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         decoder_start_token_id=2, forced_bos_token_id=1),
        image_token_id=vocab["<image>"])
    _seeded()
    model = Florence2ForConditionalGeneration(config)
    _no_special_starts(model, [vocab[token] for token in special + ["[UNK]"]], eos=vocab["</s>"])
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


# a tiny WD14 tagger's tags: (name, category, logit = bias + weights . mean BGR pixel); ratings (9),
# a character (4) and general tags (0), some scoring above their category's threshold whatever the image
TINY_WD14_TAGS = [
    ("general", 9, 5.0, (0.0, 0.0, 0.0)),
    ("sensitive", 9, -5.0, (0.0, 0.0, 0.0)),
    ("hatsune_miku", 4, -12.8, (0.0, 0.1, 0.0)),  # green images
    ("red_background", 0, 0.0, (-0.05, -0.05, 0.05)),
    ("blue_background", 0, 0.0, (0.05, -0.05, -0.05)),
    ("^_^", 0, 0.0, (0.0, 0.0, 0.0)),  # 0.5: above the general threshold
    ("simple_background", 0, -0.2, (0.0, 0.0, 0.0)),  # 0.45: above it, below ^_^
    ("outdoors", 0, -1.0, (0.0, 0.0, 0.0)),  # 0.27: below it
]


def make_tiny_wd14(out: str | Path, size: int = 32) -> Path:
    """A WD14-layout tagger (model.onnx, selected_tags.csv) whose scores are a sigmoid of the image's
    mean BGR colour: an ONNX graph built with onnx.helper, which ONNX Runtime runs as it runs the
    released taggers (NHWC BGR float input of any batch size, one score per tag)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = np.array([tag[3] for tag in TINY_WD14_TAGS], dtype=np.float32).T  # (3, tags)
    bias = np.array([tag[2] for tag in TINY_WD14_TAGS], dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("ReduceMean", ["input"], ["mean"], axes=[1, 2], keepdims=0),
         helper.make_node("MatMul", ["mean", "weights"], ["scaled"]),
         helper.make_node("Add", ["scaled", "bias"], ["logits"]),
         helper.make_node("Sigmoid", ["logits"], ["output"])],
        "tiny_wd14",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", size, size, 3])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", len(TINY_WD14_TAGS)])],
        [numpy_helper.from_array(weights, "weights"), numpy_helper.from_array(bias, "bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # readable by every ONNX Runtime of the last years
    onnx.checker.check_model(model)
    onnx.save(model, str(out / "model.onnx"))
    rows = ["tag_id,name,category,count"] + [f"{index},{name},{category},100"
                                             for index, (name, category, _, _) in enumerate(TINY_WD14_TAGS)]
    (out / "selected_tags.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return out


def make_tiny_background(out: str | Path, size: int = 32, logits: bool = True) -> Path:
    """A background-removal model in the Transformers.js layout (onnx/model.onnx and
    preprocessor_config.json, as briaai's RMBG exports): a 1x1 convolution that calls a pixel
    foreground where its red channel is high, scoring logits (`logits`: as BiRefNet / RMBG-2.0) or,
    through a sigmoid, a probability map (as RMBG-1.4 / ISNet)."""
    import json

    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    out = Path(out)
    (out / "onnx").mkdir(parents=True, exist_ok=True)
    weight = np.array([10.0, 0.0, 0.0], dtype=np.float32).reshape(1, 3, 1, 1)  # red, normalised to -0.5..0.5
    nodes = [helper.make_node("Conv", ["pixel_values", "weight", "bias"], ["logits" if not logits else "alphas"])]
    if not logits:
        nodes.append(helper.make_node("Sigmoid", ["logits"], ["alphas"]))
    graph = helper.make_graph(
        nodes, "tiny_background",
        [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("alphas", TensorProto.FLOAT, [1, 1, size, size])],
        [numpy_helper.from_array(weight, "weight"), numpy_helper.from_array(np.zeros(1, np.float32), "bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(out / "onnx" / "model.onnx"))
    (out / "preprocessor_config.json").write_text(json.dumps({
        "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [1.0, 1.0, 1.0], "do_rescale": True,
        "rescale_factor": 1 / 255, "do_resize": True, "size": {"width": size, "height": size}}), encoding="utf-8")
    return out
