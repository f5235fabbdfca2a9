"""A GGUF file's tokenizer is built by transformers once and read from the cache after (tokenizer_cache.py):
the cached tokenizer is the one transformers builds from the file, a start with it cached reads no
vocabulary out of the file, an entry belongs to one version of one file, and a tokenizer transformers
cannot build is a ValueError naming why."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from gguf import GGUFReader
from transformers import AutoTokenizer

from moe_serve.engine.gguf import tokenizer_cache, tokenizer_source
from moe_serve.engine.gguf.tokenizer_cache import CACHE_DIR_ENV, cache_dir
from moe_serve.engine.loader import open_checkpoint
from moe_serve.engine.preflight import check_model_dir
from moe_serve.engine.structured import Grammars
from moe_serve.server.tokenizer import Tokenizer
from tests.engine.gguf.gguf_tokenizers import KINDS, gguf_with_tokenizer
from tests.gguf_checkpoints import gguf_pair

TEXTS = ["hello world", " hello  world\n\n", "héllo wörld 😀", "e\u0301 <|im_start|>x<|im_end|> <s>y</s>", ""]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def _file(root: Path, kind: str) -> Path:
    """The kind's GGUF, written once per module."""
    path = root / kind / "model.gguf"
    return path if path.exists() else gguf_with_tokenizer(kind, root / kind)


@pytest.mark.parametrize("kind", KINDS)
def test_the_cached_tokenizer_is_the_one_transformers_builds_from_the_file(root: Path, kind: str,
                                                                            tokenizer_cache_dir: Path) -> None:
    gguf_file = _file(root, kind)
    folder, kwargs = tokenizer_source(gguf_file)
    assert Path(folder).parent == tokenizer_cache_dir / "gguf-tokenizers" and not kwargs
    cached = AutoTokenizer.from_pretrained(folder)
    direct = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    # the whole pipeline (normalizer, pre-tokenizer, model, post-processor, decoder, added tokens)
    assert json.loads(cached.backend_tokenizer.to_str()) == json.loads(direct.backend_tokenizer.to_str())
    assert cached.special_tokens_map == direct.special_tokens_map
    assert cached.chat_template == direct.chat_template
    for text in TEXTS:
        for special in (True, False):
            ids = direct.encode(text, add_special_tokens=special)
            assert cached.encode(text, add_special_tokens=special) == ids
            assert cached.decode(ids) == direct.decode(ids)
            assert cached.decode(ids, skip_special_tokens=True) == direct.decode(ids, skip_special_tokens=True)
    assert (cached.apply_chat_template(MESSAGES, add_generation_prompt=True)
            == direct.apply_chat_template(MESSAGES, add_generation_prompt=True))


def test_a_start_with_the_tokenizer_cached_reads_no_vocabulary(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Preflight, the server's tokenizer, the engine's checkpoint and its grammars' tokenizer: with the
    tokenizer cached, none parses the file with the gguf package's reader, which decodes every token."""
    gguf_file = _file(root, "qwen2")
    tokenizer_source(gguf_file)  # the first start's conversion

    def parse(*_):
        raise AssertionError("the gguf package's reader parsed the file")

    monkeypatch.setattr(GGUFReader, "__init__", parse)
    model = check_model_dir(str(gguf_file), "--model")
    assert Tokenizer(str(gguf_file)).encode("hello world", add_special_tokens=False)
    assert open_checkpoint(gguf_file).config == model
    assert Grammars.of_checkpoint(str(gguf_file), model.vocab_size, trust_remote_code=False).tokenizer


def test_a_file_changed_in_place_gets_a_new_entry(tmp_path: Path) -> None:
    gguf_file = gguf_with_tokenizer("qwen2", tmp_path)
    first, _ = tokenizer_source(gguf_file)
    assert tokenizer_source(gguf_file)[0] == first
    stat = gguf_file.stat()
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    second, _ = tokenizer_source(gguf_file)
    assert second != first and Path(second).is_dir()


def test_the_second_of_two_conversions_keeps_the_first_entry(root: Path, tokenizer_cache_dir: Path) -> None:
    """Two processes converting one file at once: each saves to a folder of its own and renames it into
    place; the second rename finds the first's entry and leaves it, and its own folder goes."""
    gguf_file = _file(root, "qwen2")
    entry = Path(tokenizer_source(gguf_file)[0])
    written = {f.name: f.stat().st_mtime_ns for f in entry.iterdir()}
    tokenizer_cache._save(tokenizer_cache._converted(gguf_file), entry)
    assert {f.name: f.stat().st_mtime_ns for f in entry.iterdir()} == written
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]


def test_where_no_entry_can_be_written_the_file_is_the_source(root: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    gguf_file = _file(root, "qwen2")
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "a-file" / "cache"))
    with caplog.at_level(logging.WARNING, logger=tokenizer_cache.__name__):
        assert tokenizer_source(gguf_file) == (str(gguf_file.parent), {"gguf_file": gguf_file.name})
    assert f"the tokenizer of {gguf_file} is not cached" in caplog.text
    assert Tokenizer(str(gguf_file)).encode("hello world", add_special_tokens=False)


def test_the_cache_dir_is_the_environments_or_the_users(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cache_dir() == Path(os.environ[CACHE_DIR_ENV])
    monkeypatch.delenv(CACHE_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "moe_serve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "moe_serve"


def test_a_tokenizer_transformers_cannot_build_is_a_value_error_naming_why(tmp_path: Path,
                                                                          tokenizer_cache_dir: Path) -> None:
    """Whatever transformers raises (here: a gpt-oss file, with no vocabulary besides) comes as the
    ValueError the CLIs answer with --tokenizer DIR's hint, after one attempt, and nothing is cached."""
    gguf_file, _ = gguf_pair("gpt_oss", tmp_path, expert_type="MXFP4")
    with pytest.raises(ValueError, match=r"transformers cannot build the tokenizer of this GGUF file \(\w+: "):
        Tokenizer(str(gguf_file))
    assert not any((tokenizer_cache_dir / "gguf-tokenizers").glob("*"))
