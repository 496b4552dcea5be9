"""llmcore from Python: export in one call or stage by stage, and run what was written.

* :func:`export` does what ``llmcore export`` does, from keyword arguments named like its
  flags (``plugins=["a", "b"]`` for ``--plugins a,b``), a YAML ``recipe``, or an
  :class:`~llmcore.recipe.ExportOptions`; it returns the :class:`~llmcore.pipeline.ExportResult`.
* :func:`export_steps` takes the same arguments and returns the export before its first
  stage (an :class:`~llmcore.pipeline.Export`): ``load()``, ``transform()``, ``quantize()``,
  ``capture()``, ``lower()``, ``post_passes()``, ``to_executorch()``, ``save()``, each
  leaving its module, graph or program on it to look at or change, ``quantize`` taking a
  quantizer object and ``lower`` partitioner objects in place of the plan's. Both run the
  pipeline's own stages over one resolved plan: with nothing changed, the same bytes.
* :func:`load` opens a written program with its tokenizer: :meth:`Model.generate` as
  ``llmcore run`` and :meth:`Model.chat` as ``llmcore chat``, over the same runtime.

``docs/python-api.md`` shows each; its examples run as tests. The command line is a thin
layer over these functions (``llmcore.builtins.commands``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

from llmcore.errors import LlmcoreError
from llmcore.recipe import ExportOptions

if TYPE_CHECKING:
    from llmcore.pipeline import Export, ExportResult
    from llmcore.plugins import Registry
    from llmcore.runtime.generate import GenerationStats
    from llmcore.runtime.session import Outcome


def export(options: Optional[ExportOptions] = None, /, *, recipe: Union[str, Path, None] = None,
           registry: Optional["Registry"] = None, **flags: Any) -> "ExportResult":
    """Export a model: writes the ``.pte``, its report and its tokenizer (all or nothing).

    ``flags`` are ``llmcore export``'s flags as keywords (``model``, ``config``,
    ``checkpoint``, ``plugins``, ``quantize``, ``quantize_options``, ``backend_options``,
    ``transforms``, ``skip_transforms``, ``max_seq_len``, ``output``, ..., ``quiet``: the
    fields of :class:`~llmcore.recipe.ExportOptions`), over a YAML ``recipe`` file's as on
    the command line; or pass the ``options`` themselves. ``registry``: the plugins to use
    (default: those installed)."""
    from llmcore.pipeline import export as run_export

    return run_export(export_options(options, recipe=recipe, **flags), registry)


def export_steps(options: Optional[ExportOptions] = None, /, *, recipe: Union[str, Path, None] = None,
                 registry: Optional["Registry"] = None, **flags: Any) -> "Export":
    """The export of :func:`export`'s arguments, planned (every name resolved) and not started:
    run its stages one by one, or ``save()`` for all of them."""
    from llmcore.pipeline import Export

    return Export(export_options(options, recipe=recipe, **flags), registry)


def export_options(options: Optional[ExportOptions] = None, /, *, recipe: Union[str, Path, None] = None,
                   **flags: Any) -> ExportOptions:
    """:class:`~llmcore.recipe.ExportOptions` from keywords named like ``llmcore export``'s
    flags (checked as a recipe's keys are: names and types), over a ``recipe`` file's."""
    from llmcore.recipe import build_options, load_recipe, parse_recipe

    if options is not None:
        if recipe is not None or flags:
            raise TypeError("pass either ExportOptions or keyword options (and a recipe), not both")
        return options
    quiet = flags.pop("quiet", None)
    given = parse_recipe({k: v for k, v in flags.items() if v is not None}, source="the export's arguments")
    if quiet is not None:
        given["quiet"] = bool(quiet)
    return build_options(load_recipe(recipe) if recipe is not None else {}, given)


# ---- running a written program ---------------------------------------------------------------


@dataclass(frozen=True)
class Completion:
    """What :meth:`Model.generate` produced: the reply's text (special tokens left out), the
    prompt's and the reply's token ids, and the generation's figures."""

    text: str
    prompt_ids: list[int]
    generated_ids: list[int]
    stats: "GenerationStats"


def load(path: Union[str, Path], *, tokenizer: Union[str, Path, None] = None) -> "Model":
    """Load a written ``.pte`` with the ``tokenizer.json`` next to it (or ``tokenizer``)."""
    return Model(path, tokenizer=tokenizer)


class Model:
    """A program loaded with the ExecuTorch runtime (:class:`llmcore.runtime.Program`, as
    ``program``) and its tokenizer (``tokenizer``)."""

    def __init__(self, path: Union[str, Path], *, tokenizer: Union[str, Path, None] = None):
        from llmcore.runtime import Program
        from llmcore.runtime.generate import TextTokenizer, tokenizer_beside

        self.path = path
        self.tokenizer_path = tokenizer or tokenizer_beside(path)
        self.program = Program.load(path)
        self.tokenizer = TextTokenizer.from_file(self.tokenizer_path)
        self._engine = None  # chat()'s session over the program, made on first use

    def prompt_ids(self, prompt: str, *, chat: bool = False, chat_template: Optional[str] = None) -> list[int]:
        """The ids the program is given for ``prompt``: its BOS first where it has one; with
        ``chat`` (implied by ``chat_template``: a built-in's name or a Jinja file), the prompt as
        one user message in the chat template (the one saved with the program, by default)."""
        from llmcore.runtime.chat_template import apply_template
        from llmcore.runtime.generate import prompt_ids_for

        if chat or chat_template:
            prompt = apply_template(self.tokenizer_path, prompt, chat_template)
        return prompt_ids_for(self.program, self.tokenizer, prompt)

    def generate(self, prompt: Union[str, Sequence[int]], max_new_tokens: int = 64, *, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None, chat: bool = False,
                 chat_template: Optional[str] = None, constraint: Any = None,
                 on_text: Optional[Callable[[str], None]] = None) -> Completion:
        """Generate up to ``max_new_tokens`` after ``prompt`` (a text, or ids from
        :meth:`prompt_ids`), stopping at an EOS id: ``llmcore run``. ``temperature`` 0 is greedy;
        ``on_text`` gets the reply's text as it is generated; ``constraint``
        (:class:`llmcore.runtime.constrain.Constraint`) keeps it inside a grammar."""
        from llmcore.runtime.generate import Sampling, TextStream, generate

        sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        ids = list(prompt) if not isinstance(prompt, str) else self.prompt_ids(
            prompt, chat=chat, chat_template=chat_template)
        stream = TextStream(self.tokenizer, on_text) if on_text is not None else None
        if self._engine is not None:
            self._engine.cached = []  # this run overwrites the cache a conversation kept
        result = generate(self.program, ids, max_new_tokens, sampling, on_token=stream, constraint=constraint)
        text = self.tokenizer.decode(result.generated_ids, skip_special_tokens=True)
        return Completion(text, result.prompt_ids, result.generated_ids, result.stats)

    def chat(self, messages: Sequence[dict], max_new_tokens: int = 256, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: Optional[int] = None, chat_template: Optional[str] = None,
             on_text: Optional[Callable[[str], None]] = None) -> "Outcome":
        """The assistant's reply to ``messages`` (``{"role": ..., "content": ...}``, as OpenAI's
        API takes them), written with the program's chat template (or ``chat_template``): ``llmcore
        chat``'s turn. The program's KV cache keeps the conversation, so the next call with these
        messages, the reply and a new one prefills only the new tokens. Returns the
        :class:`llmcore.runtime.session.Outcome` (text, finish reason, token counts)."""
        import threading

        from llmcore.runtime.chat_template import TEMPLATE_CHOICES, load_template
        from llmcore.runtime.generate import Sampling, prompt_ids_for
        from llmcore.runtime.session import Engine, Request, run

        Sampling(temperature=temperature, top_p=top_p)  # refuses bad values before anything runs
        template = load_template(self.tokenizer_path, chat_template)
        if template is None:
            raise LlmcoreError("this model has no chat template.", stage="chat",
                               fix=f"pass chat_template with {TEMPLATE_CHOICES}, or use generate() with the "
                                   "prompt in the model's own format.")
        if self._engine is None:
            self._engine = Engine(self.path, self.tokenizer_path, program=self.program, tokenizer=self.tokenizer)
        engine = self._engine
        ids = prompt_ids_for(self.program, self.tokenizer, template.render(list(messages)))
        room = self.program.max_context_len - len(ids)
        if room < 1:
            raise LlmcoreError(f"the conversation is {len(ids)} tokens, more than the program's "
                               f"{self.program.max_context_len}.", stage="chat",
                               fix="start a new conversation, or export with a larger --max-seq-len.")
        request = Request(ids, min(max_new_tokens, room), temperature, top_p, seed, template.stop_strings)
        return run(engine, request, on_text or (lambda text: None), threading.Event())
