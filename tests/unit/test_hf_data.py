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
from fsdpkit.train.loop import masked_loss_sum  # noqa: E402

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


def test_packed_samples_decode_back_to_the_documents(tmp_path, hf_tokenizer_dir, tok):
    docs = [r["text"] for r in _rows("text.jsonl", 12)]
    train, val = _data(tmp_path, hf_tokenizer_dir, [_write(tmp_path / "docs.jsonl", [{"text": d} for d in docs])],
                       "data.seq_len=16", "data.val_fraction=0.25")
    assert train.report.documents == 9 and val.report.documents == 3  # the last quarter is held out
    tokens = train.batch(list(range(len(train))))  # [N, 17]: windows overlap by one token
    stream = torch.cat([tokens[:, :-1].flatten(), tokens[-1:, -1]])
    text = tok.decode(stream.tolist())
    joined = "".join(d + EOS for d in docs[:9])
    assert text == joined[: len(text)] and len(joined) - len(text) < 17 * 16  # all but a last partial window
    val_text = tok.decode(val.batch([0])[0].tolist())
    assert val_text == "".join(d + EOS for d in docs[9:])[: len(val_text)]
    inputs, targets = train.labeled_batch([0, 1])
    assert (targets == tokens[:2, 1:]).all() and (inputs == tokens[:2, :-1]).all()
    assert train.target_count([0, 1]) == 2 * 16


def test_chat_targets_are_the_assistant_replies_only(tmp_path, hf_tokenizer_dir, tok):
    convs = _rows("chat.jsonl", 4)
    train, _ = _data(tmp_path, hf_tokenizer_dir, [_write(tmp_path / "chat.jsonl", convs)],
                     "data.messages_field=messages",
                     "data.packing=false", "data.seq_len=128", "data.val_fraction=0.25")
    assert len(train) == 3
    _, targets = train.labeled_batch([0, 1, 2])
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
    from fsdpkit.model import build_model

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
        summed = sum(float(masked_loss_sum(model, *train.labeled_batch([i]))) for i in (0, 1))
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

    from fsdpkit.export.hf_import import load_hf_weights
    from fsdpkit.model import build_model
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
