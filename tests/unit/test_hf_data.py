"""data.kind=hf in one process: packing, padding, chat masks, overlong counts, the masked loss
against a hand-computed reference, the cache key, and the errors users can cause."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import EXAMPLE_DATA  # noqa: E402
from fsdpkit.config import compose_config  # noqa: E402
from fsdpkit.data import GlobalSampler, build_datasets  # noqa: E402
from fsdpkit.data.token_cache import TokenizeSpec, cache_key  # noqa: E402
from fsdpkit.data.tokenizer import check_vocab, load_tokenizer, tokenizer_fingerprint  # noqa: E402
from fsdpkit.train.loss import masked_loss_terms  # noqa: E402

EOS = "<|endoftext|>"


def _rows(name: str, n: int) -> list[dict]:
    return [json.loads(line) for line in open(EXAMPLE_DATA / name)][:n]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _data(tmp_path: Path, tok_dir: Path, files: list[Path], *extra: str):
    cfg = compose_config(["data=hf", f"data.files=[{','.join(map(str, files))}]", f"data.tokenizer={tok_dir}",
                          f"data.cache_dir={tmp_path / 'cache'}", *extra]).data
    return build_datasets(cfg, vocab_size=512, seed=0)


@pytest.fixture(scope="module")
def tok(hf_tokenizer_dir):
    return load_tokenizer(str(hf_tokenizer_dir))


def test_concatenated_samples_decode_back_to_the_documents(tmp_path, hf_tokenizer_dir, tok):
    docs = [r["text"] for r in _rows("text.jsonl", 12)]
    train, val = _data(tmp_path, hf_tokenizer_dir, [_write(tmp_path / "docs.jsonl", [{"text": d} for d in docs])],
                       "data.packing=concat", "data.seq_len=16", "data.val_fraction=0.25")
    assert train.report.documents == 9 and val.report.documents == 3  # the last quarter is held out
    tokens = train.batch(list(range(len(train))))  # [N, 17]: windows overlap by one token
    stream = torch.cat([tokens[:, :-1].flatten(), tokens[-1:, -1]])
    text = tok.decode(stream.tolist())
    joined = "".join(d + EOS for d in docs[:9])
    assert text == joined[: len(text)] and len(joined) - len(text) < 17 * 16  # all but a last partial window
    val_text = tok.decode(val.batch([0])[0].tolist())
    assert val_text == "".join(d + EOS for d in docs[9:])[: len(val_text)]
    inputs, targets, positions = train.labeled_batch([0, 1])
    assert (targets == tokens[:2, 1:]).all() and (inputs == tokens[:2, :-1]).all() and positions is None
    assert train.target_count([0, 1]) == 2 * 16


def _documents_of(batch) -> list[tuple[list[int], list[int]]]:
    """(inputs, targets) of each document of each row of a Batch, cut where the positions restart,
    the padding (no trained target) left out."""
    out = []
    for inputs, targets, positions in zip(*batch, strict=True):
        starts = (positions == 0).nonzero().flatten().tolist() + [len(positions)]
        for a, b in zip(starts, starts[1:], strict=False):
            assert positions[a:b].tolist() == list(range(b - a))  # positions restart at 0 and count up
            if (targets[a:b] != -100).any():
                out.append((inputs[a:b].tolist(), targets[a:b].tolist()))
    return out


def test_packing_keeps_every_document_whole_and_apart(tmp_path, hf_tokenizer_dir, tok):
    docs = [r["text"] for r in _rows("text.jsonl", 40)]
    path = _write(tmp_path / "docs.jsonl", [{"text": d} for d in docs])
    train, _ = _data(tmp_path, hf_tokenizer_dir, [path], "data.seq_len=64", "data.val_fraction=0.25",
                     "data.overlong=split")
    encoded = [tok(d + EOS, add_special_tokens=False)["input_ids"] for d in docs[:30]]
    rows = list(range(len(train)))
    batch = train.labeled_batch(rows)
    assert batch.inputs.shape == batch.targets.shape == batch.positions.shape == (len(train), 64)
    got = _documents_of(batch)
    # every document once, whole: a short one as one piece, a long one as consecutive windows of 64 targets
    expected = []
    for ids in encoded:
        for a in range(0, len(ids) - 1, 64):
            piece = ids[a : a + 65]
            expected.append((piece[:-1], piece[1:]))
    assert sorted(got) == sorted(expected)
    assert train.report.split == sum(len(ids) > 65 for ids in encoded) > 0
    assert train.target_count(rows) == int((batch.targets != -100).sum()) == sum(len(ids) - 1 for ids in encoded)
    assert train.report.samples == len(train) < len(expected)  # several documents per sample
    padding = float((batch.targets == -100).float().mean())
    assert padding == pytest.approx(train.report.padding) and padding < 0.15
    # the same samples every time they are built (any rank, any world size), and in any order of reading
    again, _ = _data(tmp_path, hf_tokenizer_dir, [path], "data.seq_len=64", "data.val_fraction=0.25",
                     "data.overlong=split")
    assert all(torch.equal(a, b) for a, b in zip(again.labeled_batch(rows[::-1]), train.labeled_batch(rows[::-1]),
                                                  strict=True))
    # overlong documents cut to one window, or left out, are counted; nothing else is lost
    cut, _ = _data(tmp_path, hf_tokenizer_dir, [path], "data.seq_len=64", "data.val_fraction=0.25")
    dropped, _ = _data(tmp_path, hf_tokenizer_dir, [path], "data.seq_len=64", "data.val_fraction=0.25",
                       "data.overlong=drop")
    long = sum(len(ids) > 65 for ids in encoded)
    assert (cut.report.truncated, dropped.report.dropped) == (long, long)
    assert cut.report.trained_tokens == sum(min(len(ids), 65) - 1 for ids in encoded)
    assert dropped.report.trained_tokens == sum(len(ids) - 1 for ids in encoded if len(ids) <= 65)
    assert sorted(_documents_of(dropped.labeled_batch(list(range(len(dropped)))))) == sorted(
        (ids[:-1], ids[1:]) for ids in encoded if len(ids) <= 65)


def test_packed_chat_trains_on_the_assistant_replies_only(tmp_path, hf_tokenizer_dir, tok):
    convs = _rows("chat.jsonl", 12)
    convs.insert(3, {"messages": [{"role": "user", "content": "no reply to this one"}]})  # nothing to train
    train, _ = _data(tmp_path, hf_tokenizer_dir, [_write(tmp_path / "chat.jsonl", convs)],
                     "data.messages_field=messages", "data.seq_len=256", "data.val_fraction=0.1",
                     "data.overlong=drop")
    assert train.report.untrained == 1  # counted and left out
    batch = train.labeled_batch(list(range(len(train))))
    replies = sorted(tok.decode([t for t in targets if t != -100]) for _, targets in _documents_of(batch))
    expected = sorted("".join(m["content"] + "<|end|>\n" for m in c["messages"] if m["role"] == "assistant")
                      for c in convs[:12] if any(m["role"] == "assistant" for m in c["messages"]))
    assert train.report.documents == 12 and train.report.dropped == 0 and replies == expected and len(expected) == 11
    assert train.target_count(list(range(len(train)))) == int((batch.targets != -100).sum())


def test_chat_targets_are_the_assistant_replies_only(tmp_path, hf_tokenizer_dir, tok):
    convs = _rows("chat.jsonl", 4)
    train, _ = _data(tmp_path, hf_tokenizer_dir, [_write(tmp_path / "chat.jsonl", convs)],
                     "data.messages_field=messages",
                     "data.packing=false", "data.seq_len=128", "data.val_fraction=0.25")
    assert len(train) == 3
    targets = train.labeled_batch([0, 1, 2]).targets
    for row, conv in zip(targets, convs, strict=False):
        trained = row[row != -100].tolist()
        replies = "".join(m["content"] + "<|end|>\n" for m in conv["messages"] if m["role"] == "assistant")
        assert tok.decode(trained) == replies
    assert train.target_count([0, 1, 2]) == int((targets != -100).sum())


def test_overlong_conversations_are_truncated_or_dropped_and_counted(tmp_path, hf_tokenizer_dir, tok):
    convs = _rows("chat.jsonl", 40)
    path = _write(tmp_path / "chat.jsonl", convs)
    lengths = [len(tok(tok.apply_chat_template(c["messages"], tokenize=False), add_special_tokens=False)["input_ids"])
               for c in convs[:30]]
    long = sum(n > 41 for n in lengths)
    assert 0 < long < 30
    common = ("data.messages_field=messages", "data.packing=false", "data.seq_len=40", "data.val_fraction=0.25")
    cut, _ = _data(tmp_path, hf_tokenizer_dir, [path], *common, "data.overlong=truncate")
    assert (cut.report.truncated, cut.report.dropped, len(cut)) == (long, 0, 30)
    assert cut.batch(list(range(30))).shape == (30, 41)
    dropped, _ = _data(tmp_path, hf_tokenizer_dir, [path], *common, "data.overlong=drop")
    assert (dropped.report.truncated, dropped.report.dropped, len(dropped)) == (0, long, 30 - long)
    assert dropped.corpus.key == cut.corpus.key and not dropped.corpus.built  # one tokenization for both


def test_masked_sft_loss_equals_a_hand_computed_reference(tmp_path, hf_tokenizer_dir, tok):
    from fsdpkit.hf import build_model

    convs = [{"messages": [{"role": "user", "content": "What is one plus one?"},
                           {"role": "assistant", "content": "One plus one is two."}]},
             {"messages": [{"role": "system", "content": "Answer in words."},
                           {"role": "user", "content": "What is two times three?"},
                           {"role": "assistant", "content": "Six."},
                           {"role": "user", "content": "And two minus two?"},
                           {"role": "assistant", "content": "Zero, as two minus two is zero."}]},
             {"messages": [{"role": "user", "content": "held out"}, {"role": "assistant", "content": "yes"}]}]
    train, _ = _data(tmp_path, hf_tokenizer_dir, [_write(tmp_path / "tiny.jsonl", convs)],
                     "data.messages_field=messages",
                     "data.packing=false", "data.seq_len=64", "data.val_fraction=0.3")
    torch.manual_seed(0)
    model = build_model(compose_config([]).model).eval()  # the reference Llama, vocab 512

    # By hand: token positions between "prefix + assistant header" and "through the reply", per reply.
    def encode(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    total, count = 0.0, 0
    for conv in convs[:2]:
        msgs = conv["messages"]
        ids = encode(tok.apply_chat_template(msgs, tokenize=False))
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids]))[0].double(), dim=-1)  # [T, V]
        for k, m in enumerate(msgs):
            if m["role"] == "assistant":
                start = len(encode(tok.apply_chat_template(msgs[:k], tokenize=False, add_generation_prompt=True)))
                stop = len(encode(tok.apply_chat_template(msgs[: k + 1], tokenize=False)))
                for t in range(start, stop):
                    total -= float(logp[t - 1, ids[t]])
                    count += 1
    reference = total / count

    with torch.no_grad():  # as the trainer does: summed per micro-batch, divided by the global count
        summed = sum(float(masked_loss_terms(model, train.labeled_batch([i])).ce_sum) for i in (0, 1))
        packed, _ = _data(tmp_path, hf_tokenizer_dir, [tmp_path / "tiny.jsonl"], "data.messages_field=messages",
                          "data.seq_len=64", "data.val_fraction=0.3")
        assert len(packed) == 1 and packed.labeled_batch([0]).positions is not None  # both in one sample, apart
        in_one = float(masked_loss_terms(model, packed.labeled_batch([0])).ce_sum)
    assert packed.target_count([0]) == count
    assert in_one / count == pytest.approx(reference, rel=1e-6)
    assert train.target_count([0, 1]) == count
    assert summed / train.target_count([0, 1]) == pytest.approx(reference, rel=1e-6)


def test_cache_key_follows_contents_tokenizer_and_options(tmp_path, tok):
    a = _write(tmp_path / "a.jsonl", [{"text": "one plus one"}])
    b = _write(tmp_path / "b.jsonl", [{"text": "one plus one"}])
    fp = tokenizer_fingerprint(tok)

    def key(path: Path, **kw) -> str:
        spec = TokenizeSpec(files=(str(path),), builder="json", text_field=kw.get("field", "text"), messages_field="")
        return cache_key(spec, tokenizer_fingerprint=kw.get("fp", fp))

    assert key(a) == key(b)  # contents, not names
    assert key(a) != key(a, field="body") and key(a) != key(a, fp="other")
    before = key(a)
    _write(a, [{"text": "one plus two"}])
    assert key(a) != before


def test_errors_name_the_setting(tmp_path, hf_tokenizer_dir, tok):
    with pytest.raises(ValueError, match=r"model.vocab_size .* at least 4\d\d"):
        check_vocab(tok, model_vocab=256, spec=str(hf_tokenizer_dir))
    with pytest.raises(FileNotFoundError, match="data.files: .* matches no file"):
        _data(tmp_path, hf_tokenizer_dir, [tmp_path / "nothing*.jsonl"])
    doc = _write(tmp_path / "d.jsonl", [{"body": "x"}])
    with pytest.raises(ValueError, match=r"data.text_field='text' is not a column .*\['body'\]"):
        _data(tmp_path, hf_tokenizer_dir, [doc])
    with pytest.raises(ValueError, match="data.kind=hf needs data.tokenizer"):
        compose_config(["data=hf", "data.files=[x.jsonl]", "data.tokenizer=''"])
    saved = GlobalSampler(num_samples=8, global_batch_size=2, seed=0, fingerprint="aaaa").state_dict()
    with pytest.raises(ValueError, match="data cursor was saved for data aaaa but this run reads bbbb"):
        GlobalSampler(num_samples=8, global_batch_size=2, seed=0, fingerprint="bbbb").load_state_dict(saved)


def test_resize_to_tokenizer_grows_the_vocabulary_and_loads_the_folders_rows(tmp_path, hf_tokenizer_dir, tok):
    import transformers

    from fsdpkit.hf import build_model, load_hf_weights
    from fsdpkit.train.run import resize_vocab_to_tokenizer

    small = ["experiment=hf_llama", "model.vocab_size=300", "model.hf_config.vocab_size=300", "data=hf",
             "data.files=[x.jsonl]", f"data.tokenizer={hf_tokenizer_dir}"]
    cfg = compose_config(small)
    assert not resize_vocab_to_tokenizer(cfg) and cfg.model.hf_config["vocab_size"] == 300  # only when asked
    kwargs = dict(cfg.model.hf_config)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs))
    base.save_pretrained(tmp_path / "base")

    cfg = compose_config([*small, "model.resize_to_tokenizer=true"])
    assert resize_vocab_to_tokenizer(cfg) and cfg.model.hf_config["vocab_size"] == cfg.model.vocab_size == len(tok)
    model = build_model(cfg.model)
    torch.nn.init.zeros_(model.lm_head.weight)
    report = load_hf_weights(model, tmp_path / "base", grow_rows=True)
    assert report["grown"] == {"model.embed_tokens.weight": 300, "lm_head.weight": 300}
    assert torch.equal(model.lm_head.weight[:300], base.lm_head.weight)
    assert not model.lm_head.weight[300:].any()  # rows the folder does not have keep their init
    with pytest.raises(Exception, match="shape differs"):
        load_hf_weights(build_model(cfg.model), tmp_path / "base")  # without grow_rows: refused


@pytest.mark.parametrize("kind", ["llama", "hf"])
def test_the_same_documents_packed_or_one_per_sample_give_the_same_loss_and_gradient(tmp_path, hf_tokenizer_dir,
                                                                                    kind):
    """Every document of a split, packed (several per sample, kept apart) or padded (one per sample):
    the objective the trainer forms (summed CE over the batch's trained tokens) and its gradient norm
    agree within 1e-6, for fsdpkit's Llama (document mask) and a transformers model (position_ids)."""
    from fsdpkit.hf import build_model
    from fsdpkit.train.loss import micro_batch_terms

    convs = _rows("chat.jsonl", 24)
    path = _write(tmp_path / "chat.jsonl", convs)
    common = ("data.messages_field=messages", "data.seq_len=96", "data.val_fraction=0.1", "data.overlong=split")
    packed, _ = _data(tmp_path, hf_tokenizer_dir, [path], *common, "data.packing=true")
    padded, _ = _data(tmp_path, hf_tokenizer_dir, [path], *common, "data.packing=false")
    assert len(packed) < len(padded) and packed.report.trained_tokens == padded.report.trained_tokens
    model = build_model(compose_config(["experiment=hf_llama"] if kind == "hf" else []).model).double()

    def objective(data) -> tuple[float, float]:
        model.zero_grad()
        rows = list(range(len(data)))
        total = data.target_count(rows)
        loss = 0.0
        for a in range(0, len(rows), 4):  # micro-batches of 4 samples, as the trainer runs them
            terms = micro_batch_terms(model, data, rows[a : a + 4], device=torch.device("cpu"))
            (terms.ce_sum / total).backward()
            loss += float(terms.ce_sum.detach()) / total
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        return loss, float(norm)

    (loss_packed, norm_packed), (loss_padded, norm_padded) = objective(packed), objective(padded)
    assert loss_packed == pytest.approx(loss_padded, rel=1e-6) and norm_packed == pytest.approx(norm_padded, rel=1e-6)
