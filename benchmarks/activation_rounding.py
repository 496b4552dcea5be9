"""What rounding a model's activations to int8 costs, by scheme, in eager PyTorch.

Runs a checkpoint's float model (a GGUF's integers decoded: the file's own floats) on a text,
once with every linear's input as it is and once per scheme with each linear's input rounded
to int8 before the product, and prints each scheme's mean KL divergence from the unrounded
model's next-token distribution and how often the top token stays the same. The weights are
not touched, so the figures are the activations' share of what a quantized program loses:

  per-token   one asymmetric scale a token (XNNPACK's qd8, and llmcore-kernels' int8 rows)
  per-block   one symmetric scale a block of 32 (llama.cpp's Q8 activations, and llmcore-kernels'
              int4 and int8-block layers: docs/quantization.md)

    python benchmarks/activation_rounding.py --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf

``--prompt-file FILE`` also prints, per scheme, the three likeliest next tokens after the
file's text (tokenized as it is: a chat template already applied, as `make demo` writes
out/smollm2/prompt.txt), with their logits: where the float model is near a tie, a rounding
picks a side. ``--per-token-for NAME`` adds a third scheme: per token for the linears whose
name contains NAME, per block for the others.

Llama-family models (llmcore-llama's Transformer: its ``layers``, ``norm`` and ``output``).
The schemes are llmcore_xnnpack.qlinear's roundings (docs/quantization.md, "Activations
rounded per block").
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

DEFAULT_TEXT = Path(__file__).parent / "data" / "alice-chapter1.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a Llama-family checkpoint llmcore export reads (a GGUF)")
    parser.add_argument("--text", default=str(DEFAULT_TEXT), help="the text scored (its first --tokens tokens)")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--prompt-file", help="also: the likeliest next tokens after this text, per scheme")
    parser.add_argument("--per-token-for", metavar="NAME",
                        help="also: per token for the linears named with NAME, per block for the others")
    args = parser.parse_args()

    import llmcore
    from llmcore_xnnpack import qlinear
    from tokenizers import Tokenizer

    torch.set_num_threads(2)
    steps = llmcore.export_steps(checkpoint=args.checkpoint, quantize="none", output="unused.pte", quiet=True)
    steps.load()
    model = steps.module.float().eval()
    tokenizer = Tokenizer.from_str(steps.loaded.tokenizer.json_text)
    tokens = torch.tensor([tokenizer.encode(Path(args.text).read_text()).ids[: args.tokens]])
    # The model returns the last position's logits: every position's come from the last
    # layer's output, normed and projected here.
    last = {}
    model.layers[-1].register_forward_hook(lambda m, i, out: last.__setitem__("h", out[0] if isinstance(out, tuple) else out))
    linear_forward = torch.nn.Linear.forward
    names = {module: name for name, module in model.named_modules()}
    schemes = {"float": None, "per-token": lambda layer: qlinear.rounded_per_token,
               "per-block": lambda layer: qlinear.rounded_per_block}
    if args.per_token_for:
        schemes[f"per-block, {args.per_token_for} per token"] = lambda layer: (
            qlinear.rounded_per_token if args.per_token_for in names[layer] else qlinear.rounded_per_block)
    prompt = None
    if args.prompt_file:
        prompt = torch.tensor([tokenizer.encode(Path(args.prompt_file).read_text(), add_special_tokens=False).ids])
    log_probs, next_tokens = {}, {}
    try:
        for name, rounding in schemes.items():
            torch.nn.Linear.forward = (linear_forward if rounding is None else
                                       lambda self, x, rounding=rounding: linear_forward(self, rounding(self)(x)))
            with torch.no_grad():
                model(tokens)
                log_probs[name] = torch.log_softmax(model.output(model.norm(last["h"]))[0].float(), -1)
                if prompt is not None:
                    top = torch.topk(model(prompt).reshape(-1), 3)
                    next_tokens[name] = ", ".join(f"{tokenizer.decode([int(i)])!r} {float(v):.3f}"
                                                  for v, i in zip(top.values, top.indices))
    finally:
        torch.nn.Linear.forward = linear_forward
    reference = log_probs["float"]
    print(f"{Path(args.checkpoint).name}, {tokens.shape[1]} tokens of {Path(args.text).name}, the weights as the file holds them")
    for name in list(schemes)[1:]:
        kl = (reference.exp() * (reference - log_probs[name])).sum(-1)
        same = (log_probs[name].argmax(-1) == reference.argmax(-1)).float().mean()
        print(f"  {name:10s}  mean KL {float(kl.mean()):.5f}, p99 {float(kl.quantile(0.99)):.4f}, same top token {100 * float(same):.1f}%")
    for name, line in next_tokens.items():
        print(f"  next after the prompt, {name}: {line}")


if __name__ == "__main__":
    main()
