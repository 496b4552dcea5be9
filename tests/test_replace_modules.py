"""llmcore.modules.replace_modules: the one module-swap loop every transform uses."""

from __future__ import annotations

from torch import nn

from llmcore.modules import CausalAttention, replace_modules


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = CausalAttention(4, 2, 8)
        self.mlp = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 4)


class Wrapped(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner


def test_a_class_selects_its_instances_at_any_depth():
    model = Model()
    assert replace_modules(model, CausalAttention, lambda a: nn.Identity()) == 2
    assert all(isinstance(layer.attn, nn.Identity) for layer in model.layers)
    assert replace_modules(model, CausalAttention, lambda a: nn.Identity()) == 0


def test_a_predicate_selects_and_a_replacement_is_not_searched():
    model = Model()
    exact_linear = lambda m: type(m) is nn.Linear  # noqa: E731
    assert replace_modules(model, exact_linear, Wrapped) == 5  # two per block, and the head
    assert isinstance(model.head, Wrapped) and type(model.head.inner) is nn.Linear  # not wrapped twice


def test_none_keeps_a_module_and_its_children_are_searched():
    model = nn.Sequential(Wrapped(nn.Linear(2, 2)), nn.Linear(2, 2))
    seen = []

    def make(m):
        seen.append(m)
        return None if isinstance(m, Wrapped) else nn.Identity()

    assert replace_modules(model, (Wrapped, nn.Linear), make) == 2
    assert isinstance(model[0], Wrapped) and isinstance(model[0].inner, nn.Identity)
    assert isinstance(model[1], nn.Identity)
    assert len(seen) == 3


def test_the_root_is_never_replaced():
    root = nn.Linear(2, 2)
    assert replace_modules(root, nn.Linear, lambda m: nn.Identity()) == 0


def test_unusual_attention_is_refused_by_layer_name_unless_the_backend_takes_its_type():
    import pytest

    from llmcore.errors import LlmcoreError
    from llmcore.modules import refuse_unusual_attention

    class Windowed(CausalAttention):
        pass

    model = nn.ModuleDict({"plain": CausalAttention(2, 2, 4), "local": Windowed(2, 2, 4, window=8),
                           "capped": CausalAttention(2, 2, 4, softcap=30.0)})
    with pytest.raises(LlmcoreError) as err:
        refuse_unusual_attention(model, plugin="somebackend", form="its attention form", fix="do X.")
    assert err.value.one_line() == ("[transform/somebackend] local uses sliding-window attention, which its "
                                    "attention form does not implement. Fix: do X.")
    with pytest.raises(LlmcoreError, match="capped uses soft-capped attention scores"):
        refuse_unusual_attention(model, plugin="somebackend", form="its attention form", fix="do X.",
                                 allowed=(Windowed,))
    del model["capped"]
    refuse_unusual_attention(model, plugin="somebackend", form="its attention form", fix="do X.", allowed=(Windowed,))
