"""A synthetic English-like corpus for the data benchmarks (experiments/benchmarks/data_loader.py): made-up
words drawn from a Zipf law over a fixed vocabulary, in documents of log-normal lengths, written as JSONL,
and a byte-level BPE tokenizer trained on it. Deterministic in its seeds; nothing is downloaded."""

import json
import os
import pathlib
import time

import numpy as np

EOS = "<|endoftext|>"  # the BPE tokenizer's end-of-document token


def make_vocabulary(size: int = 4096, seed: int = 1234) -> list[str]:
  """Distinct made-up words of 1-4 syllables, shortest first (so the frequent ones are short, as in English)."""
  rng = np.random.default_rng(seed)
  onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "th", "st", "br",
            "ch", "sh", "tr", "pl"]
  vowels = ["a", "e", "i", "o", "u", "ea", "ou", "ai", "y"]
  codas = ["", "", "n", "r", "s", "t", "l", "nd", "ng", "st"]
  words: dict[str, None] = {}
  while len(words) < size:
    syllables = 1 + min(3, int(rng.geometric(0.45)) - 1)
    words.setdefault("".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                             for _ in range(syllables)), None)
  return sorted(words, key=lambda w: (len(w), w))


def write_corpus(path: pathlib.Path, num_bytes: int, seed: int = 0) -> dict:
  """A JSONL file ({"text": ...} per line) of at least `num_bytes`: Zipf-distributed words, with capitalised
  sentence starts, commas, full stops, some numbers and paragraph breaks. Deterministic in `seed`."""
  if path.is_file() and path.stat().st_size >= num_bytes and path.with_suffix(".done").is_file():
    return json.loads(path.with_suffix(".done").read_text())
  rng = np.random.default_rng(seed)
  vocab = make_vocabulary()
  # Token table: each word with an inflection (none, -s, -ed, -ing, -er, -ly), lower-case and capitalised,
  # then punctuation (glued to the word before) and numbers.
  n = len(vocab)
  suffixes, suffix_p = ["", "s", "ed", "ing", "er", "ly"], [0.6, 0.15, 0.1, 0.07, 0.04, 0.04]
  forms = [w + x for x in suffixes for w in vocab]
  table = [" " + w for w in forms] + [" " + w.capitalize() for w in forms] + [",", ".", ".\\n\\n"] + [
      f" {k}" for k in range(2000)]
  blob = np.frombuffer("".join(table).encode(), np.uint8)
  lengths = np.asarray([len(t) for t in table], np.int64)
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
  ranks = np.arange(1, n + 1, dtype=np.float64)
  zipf = 1 / (ranks + 2.7) ** 1.07
  zipf /= zipf.sum()
  capital, comma = len(forms), 2 * len(forms)
  stop, para, number = comma + 1, comma + 2, comma + 3
  written = docs = words_total = 0
  tmp = path.with_name(path.name + ".tmp")
  with open(tmp, "wb") as f:
    while written < num_bytes:
      # A chunk of documents: word counts log-normal (median ~400 words, from a few words to tens of thousands).
      doc_words = np.clip(rng.lognormal(6.0, 1.1, 512).astype(np.int64), 5, 60_000)
      total = int(doc_words.sum())
      ids = rng.choice(n, size=total, p=zipf) + n * rng.choice(len(suffixes), size=total, p=suffix_p)
      # Sentences of ~ 5-30 words: the word after a full stop is capitalised.
      kind = rng.random(total)
      ends = kind < 1 / 16
      ids = np.where(np.concatenate([[True], ends[:-1]]), ids + capital, ids)  # capitalise after a stop
      ids = np.where(rng.random(total) < 0.01, number + rng.integers(0, 2000, total), ids)
      punct = np.where(ends, np.where(rng.random(total) < 0.15, para, stop), np.where(kind < 0.11, comma, -1))
      seq = np.stack([ids, punct], 1).reshape(-1)
      doc_ends = np.cumsum(doc_words) * 2
      seq[doc_ends - 1] = stop  # every document ends a sentence
      keep = seq >= 0
      tok_ids = seq[keep]
      tok_doc_ends = np.cumsum(keep)[doc_ends - 1]
      out_len = lengths[tok_ids]
      out_end = np.cumsum(out_len)
      gather = np.repeat(starts[tok_ids] - (out_end - out_len), out_len) + np.arange(int(out_end[-1]))
      text = blob[gather].tobytes()
      begin = 0
      for end_tok in tok_doc_ends:
        end = int(out_end[end_tok - 1])
        f.write(b'{"text": "' + text[begin + 1:end] + b'"}\n')  # +1: the leading space
        begin = end
      written, docs, words_total = f.tell(), docs + len(doc_words), words_total + total
  os.replace(tmp, path)
  info = {"bytes": path.stat().st_size, "documents": docs, "words": words_total, "vocabulary_words": n}
  path.with_suffix(".done").write_text(json.dumps(info))
  return info


def train_bpe(corpus: pathlib.Path, out: pathlib.Path, vocab_size: int = 32768, sample_bytes: int = 16 << 20) -> dict:
  """A byte-level BPE tokenizer.json trained on the first `sample_bytes` of the corpus (EOS <|endoftext|>)."""
  if out.is_file():
    return json.loads(out.with_suffix(".info").read_text())
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  texts = []
  with open(corpus, "rb") as f:
    for line in f.read(sample_bytes).splitlines()[:-1]:  # the last line may be cut
      texts.append(json.loads(line)["text"])
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  start = time.perf_counter()
  tok.train_from_iterator(texts, trainer)
  tok.save(str(out))
  info = {"vocab_size": tok.get_vocab_size(), "sample_bytes": sample_bytes,
          "train_seconds_not_counted": time.perf_counter() - start}
  out.with_suffix(".info").write_text(json.dumps(info))
  return info
