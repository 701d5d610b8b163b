"""LikesWorld episodes (lecture 5, sec. 2.2): facts, then questions answered by the word after
`q NAME`.

    <bos> eve likes tea . dan likes jam . hal likes figs . gus likes plums . q dan jam . q gus plums . <eos>

Answering needs a two-step lookup: each item must learn its owner (the name two tokens back),
then the asked name must find the item that learned it. Copying "some item from the context"
only reaches 1/n_facts.
"""
from __future__ import annotations

import dataclasses

import numpy as np

SPECIALS = ["<pad>", "<bos>", "<eos>", "likes", ".", "q"]
NAMES = ["ann", "bob", "cat", "dan", "eve", "fay", "gus", "hal", "ivy", "jon", "kim", "leo"]
ITEMS = ["tea", "jam", "figs", "plums", "rice", "soup", "pie", "nuts", "eggs", "kale", "corn",
         "milk"]


@dataclasses.dataclass(frozen=True)
class World:
    n_facts: int = 4        # facts per episode
    n_questions: int = 2    # questions per episode (about distinct facts)

    @property
    def vocab(self) -> list[str]:
        return SPECIALS + NAMES + ITEMS

    @property
    def seq_len(self) -> int:
        return 1 + 4 * self.n_facts + 4 * self.n_questions + 1

    def tok(self, word: str) -> int:
        return self.vocab.index(word)

    def decode(self, ids) -> str:
        return " ".join(self.vocab[int(i)] for i in ids)

    def sample(self, rng: np.random.Generator, batch: int):
        """tokens [B, T] int32, answer positions [B, n_questions] (the `NAME` after `q`, whose next
        token is the answer) and the answers [B, n_questions]."""
        n_sp, n_nm = len(SPECIALS), len(NAMES)
        names = np.argsort(rng.random((batch, n_nm)), axis=1)[:, :self.n_facts] + n_sp
        items = np.argsort(rng.random((batch, len(ITEMS))), axis=1)[:, :self.n_facts] + n_sp + n_nm
        asked = np.argsort(rng.random((batch, self.n_facts)), axis=1)[:, :self.n_questions]
        likes, dot, q = self.tok("likes"), self.tok("."), self.tok("q")
        cols = [np.full(batch, self.tok("<bos>"))]
        for f in range(self.n_facts):
            cols += [names[:, f], np.full(batch, likes), items[:, f], np.full(batch, dot)]
        rows = np.arange(batch)[:, None]
        ask_names, answers = names[rows, asked], items[rows, asked]
        positions = []
        for j in range(self.n_questions):
            positions.append(len(cols) + 1)
            cols += [np.full(batch, q), ask_names[:, j], answers[:, j], np.full(batch, dot)]
        cols.append(np.full(batch, self.tok("<eos>")))
        tokens = np.stack(cols, axis=1).astype(np.int32)
        return tokens, np.array(positions)[None].repeat(batch, 0), answers.astype(np.int32)

    def context_items(self, tokens) -> np.ndarray:
        """The items stated in each episode's facts [B, n_facts] (for the random baseline)."""
        return tokens[:, 3:1 + 4 * self.n_facts:4]
