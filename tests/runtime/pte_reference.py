"""Python reference generation loop for the runner tests (ExecuTorch pybindings + HF tokenizers)."""

import torch


def _scalar(v):
    return int(v[0]) if isinstance(v, (list, tuple)) else int(v)


def load_program(pte_path):
    # Registers the llama:: custom ops (update_cache / custom_sdpa) with the runtime.
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
    from executorch.extension.pybindings.portable_lib import _load_for_executorch

    return _load_for_executorch(str(pte_path))


def program_meta(module):
    names = set(module.method_names())

    def get(name, default):
        if name not in names:
            return default
        out = module.run_method(name, ())
        return _scalar(out) if len(out) else default

    return {
        "max_seq_len": get("get_max_seq_len", 0),
        "max_context_len": get("get_max_context_len", 0),
        "bos_id": get("get_bos_id", -1),
        "n_bos": get("get_n_bos", 0),
        "use_kv_cache": bool(get("use_kv_cache", 0)),
        "eos_ids": [int(x) for x in module.run_method("get_eos_ids", ())] if "get_eos_ids" in names else [],
    }


def reference_generate(pte_path, prompt_ids, max_new_tokens):
    """Greedy generation following docs/pte-contract.md; returns the generated ids
    (an eos id, when produced, is the last one)."""
    module = load_program(pte_path)
    meta = program_meta(module)
    tokens = [meta["bos_id"]] * meta["n_bos"] if meta["bos_id"] >= 0 else []
    tokens += list(prompt_ids)
    max_seq, max_ctx = meta["max_seq_len"], meta["max_context_len"]
    generated = []
    if max_new_tokens <= 0:
        return generated

    def logits_of(out):
        t = out[0]
        return t.reshape(-1, t.shape[-1])[-1]

    if meta["use_kv_cache"]:
        n = len(tokens)
        for start in range(0, n, max_seq):
            chunk = tokens[start : start + max_seq]
            out = module.forward((torch.tensor([chunk], dtype=torch.long), torch.tensor([start], dtype=torch.long)))
        logits = logits_of(out)
    else:
        logits = logits_of(module.forward((torch.tensor([tokens[-max_seq:]], dtype=torch.long),)))
    while True:
        nxt = int(torch.argmax(logits).item())  # first max = lowest id on ties
        generated.append(nxt)
        tokens.append(nxt)
        if nxt in meta["eos_ids"] or len(generated) >= max_new_tokens:
            break
        if max_ctx > 0 and len(tokens) >= max_ctx:
            break
        if meta["use_kv_cache"]:
            out = module.forward(
                (torch.tensor([[nxt]], dtype=torch.long), torch.tensor([len(tokens) - 1], dtype=torch.long))
            )
        else:
            out = module.forward((torch.tensor([tokens[-max_seq:]], dtype=torch.long),))
        logits = logits_of(out)
    return generated
