"""The GGUF reader (decoding.forward.gguf_reader) on files written here: read_gguf puts every
block on its module (llama.cpp's q / k row order undone where its converter permuted them, K-quant
files re-laid at their own precision) and attach refuses another model's GGUF; load_blocks keeps
the blocks beside the converted target, once, and reads a changed file anew."""

import copy
import os

import pytest
import torch

from support.gguf import write_gguf
from support.models import tiny_llama
from decoding.forward import gguf_reader, quant
from decoding.models.errors import ModelError
from decoding.forward.packed import set_forward

pytestmark = pytest.mark.skipif(not quant.available(), reason=f"quantized kernel: {quant.why_not()}")


def test_gguf_blocks_land_on_their_modules(tmp_path):
    """read_gguf undoes llama.cpp's q / k row order and names every linear; attach checks each
    against the model and refuses a GGUF of another model in one line."""
    model = tiny_llama(0, vocab=32, hidden=32)
    write_gguf(model, tmp_path / "m.gguf")
    blocks = gguf_reader.read_gguf(tmp_path / "m.gguf", model.config)
    assert len(blocks) == 2 * 7 + 1
    for name, mod in model.named_modules():
        if type(mod) is torch.nn.Linear:
            assert torch.equal(blocks[f"{name}.weight"].w, quant.quantize(mod.weight, "Q4_1").w), name
    with torch.no_grad():  # the model the GGUF holds: its dense weights are the blocks' values
        for name, mod in model.named_modules():
            if type(mod) is torch.nn.Linear:
                mod.weight.copy_(blocks[f"{name}.weight"].dequant())
    assert quant.attach(model, blocks) == 15 and quant.quantized(model) == 15
    other = tiny_llama(5, vocab=32, hidden=32)
    with pytest.raises(ModelError, match="is not this model's"):
        quant.attach(other, blocks)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quant_gguf_is_read_at_its_own_precision(kind, arch):
    """A K-quant file (its K % 256 tensors in the K-quant, the others Q5_0, as a Q4_K_M holds
    them) lands re-laid on every linear, q / k rows unpermuted only where llama.cpp's converter
    permuted them (llama, not gemma3); the model on those blocks runs greedy as on its dense copy."""
    import tempfile

    model = tiny_llama(0, vocab=32, hidden=128)
    with tempfile.TemporaryDirectory() as tmp:
        write_gguf(model, f"{tmp}/m.gguf", kind=kind, arch=arch)
        blocks = gguf_reader.read_gguf(f"{tmp}/m.gguf", model.config)
    assert {w.kind for w in blocks.values()} == {quant.KINDS["Q8_0"], quant.KINDS[kind]}  # Q5_0 as Q8_0
    for name, mod in model.named_modules():
        if type(mod) is torch.nn.Linear:
            qw = blocks[f"{name}.weight"]
            assert qw.kind == quant.KINDS[kind] if mod.weight.shape[1] % 256 == 0 else qw.kind == 8, name
            with torch.no_grad():
                mod.weight.copy_(qw.dequant())
    dense = copy.deepcopy(model)
    assert quant.attach(model, blocks) == 15
    set_forward(model, "lean")
    prompt = torch.tensor([[1, 5, 7, 3]])
    with torch.no_grad():
        assert (model(prompt).logits - dense(prompt).logits).abs().max() < 0.05  # q8 activations


def test_blocks_are_kept_once_and_refreshed_with_the_file(tmp_path, monkeypatch):
    model = tiny_llama(0, vocab=32, hidden=32)
    gguf_file = tmp_path / "m.gguf"
    write_gguf(model, gguf_file)
    target = tmp_path / "target"
    target.mkdir()
    (target / "gguf_blocks.safetensors").write_bytes(b"an older version kept it inside")
    first = gguf_reader.load_blocks(gguf_file, model.config, target)
    # beside the converted directory, never inside: an engine pointed at it loads every safetensors
    assert (tmp_path / "target.gguf_blocks.safetensors").is_file() and not list(target.iterdir())
    monkeypatch.setattr(gguf_reader, "read_gguf", lambda *a: pytest.fail("the kept blocks were not used"))
    kept = gguf_reader.load_blocks(gguf_file, model.config, target)
    assert {n: (w.kind, w.k) for n, w in kept.items()} == {n: (w.kind, w.k) for n, w in first.items()}
    assert all(torch.equal(kept[n].w, first[n].w) for n in first)
    monkeypatch.undo()
    write_gguf(tiny_llama(3, vocab=32, hidden=32), gguf_file, kind="Q8_0")  # another file at that path
    os.utime(gguf_file, ns=(1, 1))
    assert all(w.kind == quant.KINDS["Q8_0"] for w in gguf_reader.load_blocks(gguf_file, model.config, target).values())
