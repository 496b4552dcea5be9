"""nanoGPT / GPT-2 for llmcore: the model family, its configs and checkpoint loaders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from llmcore import hookimpl
from llmcore.errors import LlmcoreError
from llmcore.records import (
    CheckpointLoader,
    Lazy,
    LoadedModel,
    LoadOptions,
    ModelFamily,
    ModelMetadata,
    SourceTransform,
    Tokenizer,
)

__version__ = "0.1.0"

FAMILY = "nanogpt"
GPT2_VOCAB = 50257


def _tokenizer_for(
    vocab_size: int, options: LoadOptions, checkpoint: Optional[Path] = None, *, nanogpt_ckpt: bool = False,
    dataset: Optional[str] = None,
) -> Optional[Tokenizer]:
    """The tokenizer, first found of: ``--tokenizer``; tokenizer files beside the
    checkpoint; for a nanoGPT ``ckpt.pt``, the char-level ``meta.pkl`` of its dataset (as
    nanoGPT's ``sample.py`` does); the byte-level one of a 257-token vocabulary; GPT-2's
    BPE (nanoGPT's default) for a vocabulary that holds it (50257, or 50304 as nanoGPT pads
    it). The chosen one's description goes into the export report."""
    from llmcore_nanogpt import tokenizer as tok

    if options.tokenizer_path is not None:
        return tok.load_tokenizer(options.tokenizer_path)
    if checkpoint is not None:
        folder = checkpoint if checkpoint.is_dir() else checkpoint.parent
        if tok.find_files(folder):
            return tok.load_tokenizer(folder)
    looked: list[Path] = []
    if nanogpt_ckpt and checkpoint is not None:
        looked = tok.meta_candidates(checkpoint, dataset)
        for meta in looked:
            if meta.is_file():
                found = tok.char_level_tokenizer(meta)
                size = len(json.loads(found.json_text)["model"]["vocab"])
                if size > vocab_size:
                    raise LlmcoreError(
                        f"{str(meta)!r} has {size} characters but the checkpoint's vocabulary has {vocab_size}: "
                        "they do not belong together.",
                        stage="load", plugin=FAMILY,
                        fix="pass --tokenizer with the model's tokenizer, or put the right meta.pkl beside ckpt.pt.",
                    )
                return found
    if vocab_size == 257:
        return tok.byte_level_tokenizer()
    if vocab_size >= GPT2_VOCAB and (files := tok.default_gpt2_files()) is not None:
        found = tok.load_tokenizer(files)
        return Tokenizer(found.json_text, description=f"GPT-2 BPE ({found.description} from {files})")
    if nanogpt_ckpt:
        where = ", ".join(str(p) for p in looked)
        gpt2 = (
            "its vocabulary is smaller than GPT-2's"
            if vocab_size < GPT2_VOCAB
            else "GPT-2's BPE files (nanoGPT's default) are not installed"
        )
        raise LlmcoreError(
            f"found no tokenizer for this nanoGPT checkpoint: no meta.pkl (looked at {where}) and {gpt2}.",
            stage="load", plugin=FAMILY,
            fix="put the dataset's meta.pkl beside ckpt.pt, run `make` (it fetches GPT-2's BPE) or set "
            "LLMCORE_GPT2_TOKENIZER to a folder with encoder.json + vocab.bpe, or pass --tokenizer.",
        )
    return None


def _finish(loaded: LoadedModel, options: LoadOptions) -> LoadedModel:
    """Metadata from the model config and the tokenizer's end-of-text token."""
    import json

    config = loaded.module.config
    eos: tuple[int, ...] = ()
    if loaded.tokenizer is not None:
        vocab = json.loads(loaded.tokenizer.json_text)["model"]["vocab"]
        if "<|endoftext|>" in vocab:
            eos = (vocab["<|endoftext|>"],)
    loaded.metadata = ModelMetadata(
        vocab_size=config.vocab_size,
        max_seq_len=config.block_size,
        bos_id=eos[0] if eos else -1,
        eos_ids=eos,
        n_bos=0,
    )
    return loaded


def _build_random(name: str, options: LoadOptions) -> LoadedModel:
    from llmcore_nanogpt.model import CONFIGS, GPT

    config = CONFIGS[name]
    model = GPT(config).init_random(options.seed).eval()
    loaded = LoadedModel(model, metadata=None, tokenizer=_tokenizer_for(config.vocab_size, options))
    return _finish(loaded, options)


def _loader(name: str, description: str, matches_name: str, load_name: str, claims_name: str) -> CheckpointLoader:
    def load(path: Path, options: LoadOptions) -> LoadedModel:
        from llmcore_nanogpt import loaders

        if load_name == "load_nanogpt":
            model, dataset, file = loaders.read_nanogpt(path)
            tokenizer = _tokenizer_for(model.config.vocab_size, options, path, nanogpt_ckpt=True, dataset=dataset)
            return _finish(LoadedModel(model, metadata=None, tokenizer=tokenizer, family=FAMILY, source=str(file)),
                           options)
        loaded = getattr(loaders, load_name)(path, options, None)
        loaded.tokenizer = _tokenizer_for(loaded.module.config.vocab_size, options, path)
        return _finish(loaded, options)

    return CheckpointLoader(name, description, Lazy("llmcore_nanogpt.loaders", matches_name), load,
                            claims=Lazy("llmcore_nanogpt.loaders", claims_name))


def _load_gguf(path: Path, options: LoadOptions) -> LoadedModel:
    from llmcore_nanogpt import gguf_loader

    loaded = gguf_loader.load_gguf(path, options)
    if options.tokenizer_path is not None:  # --tokenizer in place of the file's own
        loaded.tokenizer = _tokenizer_for(loaded.module.config.vocab_size, options, path)
        return _finish(loaded, options)
    return loaded


@hookimpl
def llmcore_model_families() -> list[ModelFamily]:
    return [
        ModelFamily(
            name=FAMILY,
            description="GPT-2 architecture with nanoGPT's parameter names",
            configs={
                "gpt2": "GPT-2 124M: 12 layers, 12 heads, 768 wide, 1024 positions",
                "gpt2-medium": "GPT-2 350M: 24 layers, 16 heads, 1024 wide",
                "tiny": "for tests: 2 layers, 4 heads, 64 wide, 128 positions, byte-level vocab (257)",
            },
            build_random=_build_random,
            loaders=(
                CheckpointLoader("gguf", "GGUF file of llama.cpp's gpt2 architecture (the llama plugin's GGUF types; "
                                 "the file's integers are kept by --quantize gguf) with its embedded tokenizer",
                                 Lazy("llmcore_nanogpt.gguf_loader", "claims"), _load_gguf,
                                 claims=Lazy("llmcore_nanogpt.gguf_loader", "claims")),
                _loader("hf-gpt2", "Hugging Face GPT-2 folder: config.json + model.safetensors or pytorch_model.bin",
                        "matches_hf", "load_hf", "claims_hf"),
                _loader("nanogpt-ckpt", "nanoGPT train.py checkpoint: ckpt.pt with model_args and model",
                        "matches_nanogpt", "load_nanogpt", "matches_nanogpt"),
            ),
            default_config="gpt2",
        )
    ]


def _split_qkv(module, context):
    from llmcore_nanogpt.model import split_qkv

    split_qkv(module)
    return module


@hookimpl
def llmcore_source_transforms() -> list[SourceTransform]:
    return [
        SourceTransform(
            name="split-qkv",
            description="compute q, k, v with three linears instead of splitting c_attn's output "
            "(a split XNNPACK cannot take; same values)",
            apply=_split_qkv,
            order=10,
            families=(FAMILY,),
            # Backends that take the split (Core ML, QNN, Vulkan, ...) keep one fused matmul;
            # listed after one of them, XNNPACK only gets what they leave.
            backends=("xnnpack",),
            automatic=True,
            applies=lambda context: context.first_backend == "xnnpack",
        )
    ]
