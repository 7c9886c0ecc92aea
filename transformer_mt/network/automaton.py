"""Where a constrained hypothesis stands with its sentence's terms: an Aho-Corasick automaton per
sentence over every alternative of every entry (one node space for a batch, as tensors), and how
many tokens it still needs at least before every entry is met (what keeps constrained search from
running out of room at the length limit: constraints.py).

A transition is one look-up in a sorted table of (node, token) keys; a token no alternative holds
returns to the root. `met` (rows, entries) records the entries whose alternative has appeared.

Tokens still needed from (node, met): for a sentence of a few entries, exactly: the shortest path
through the automaton to a state in which every entry is met, over the sentence's alphabet (a
Bellman iteration over its nodes × 2^entries states, made once per batch). Beyond EXACT_ENTRIES
entries, an upper bound: finish the alternative in progress that saves the most, then write each
other unmet entry's shortest alternative (the automaton meets an alternative written in full
wherever it starts); it overestimates only where alternatives overlap.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# Per sentence: its entries; per entry: its alternatives; per alternative: token ids.
Terms = Sequence[Sequence[Sequence[int]]]

EXACT_ENTRIES = 6  # entries of a sentence up to which the tokens still needed are exact
_FAR = 1 << 20  # "not on this path" and "unreachable", as a number of tokens


class Automata:
    """The Aho-Corasick automata of a batch's sentences, one node space, as tensors."""

    def __init__(self, sentences: Sequence[Terms], vocab: int, device: torch.device | str) -> None:
        self.vocab = vocab
        entries = max([len(terms) for terms in sentences] + [1])
        roots, root_of, depth, completes, starts, to_finish = [], [], [], [], [], []
        keys, values, alphabets, exact = [], [], [], []
        lengths = torch.zeros(len(sentences), entries, dtype=torch.long)
        width = 1 << min(entries, EXACT_ENTRIES)
        distances = []
        for s, terms in enumerate(sentences):
            offset = len(depth)
            roots.append(offset)
            nodes = _automaton(terms)
            for node in nodes:
                root_of.append(offset)
                depth.append(node.depth)
                completes.append(node.completes)
                starts.append(node.starts)
                to_finish.append([node.to_finish.get(e, _FAR) for e in range(entries)])
                for token, target in sorted(node.delta.items()):
                    keys.append((offset + node.index) * vocab + token)
                    values.append(offset + target)
            for e, alternatives in enumerate(terms):
                lengths[s, e] = min(len(a) for a in alternatives)
            alphabet = sorted({t for alternatives in terms for a in alternatives for t in a})
            alphabets.append(alphabet)
            exact.append(len(terms) <= EXACT_ENTRIES)
            table = _distances(nodes, len(terms), alphabet) if exact[-1] else None
            padded = np.zeros((len(nodes), width), dtype=np.int64)
            if table is not None:
                padded[:, : table.shape[1]] = table
            distances.append(padded)
        self.root = torch.tensor(roots, dtype=torch.long, device=device)  # (n,)
        self.root_of = torch.tensor(root_of, dtype=torch.long, device=device)  # (nodes,)
        self.depth = torch.tensor(depth, dtype=torch.long, device=device)
        self.completes = _bits(completes, entries, device)  # (nodes, E)
        self.starts = _bits(starts, entries, device)  # (nodes, E): starts an alternative of e
        self.to_finish = torch.tensor(to_finish, dtype=torch.long, device=device)  # (nodes, E)
        self.distance = torch.from_numpy(np.concatenate(distances)).to(device)  # (nodes, 2^E')
        self.exact = torch.tensor(exact, device=device)  # (n,)
        order = sorted(range(len(keys)), key=keys.__getitem__)
        self.keys = torch.tensor([keys[i] for i in order], dtype=torch.long, device=device)
        self.values = torch.tensor([values[i] for i in order], dtype=torch.long, device=device)
        self.real = torch.tensor(  # (n, E): the entries each sentence has
            [[e < len(terms) for e in range(entries)] for terms in sentences], device=device
        )
        self.lengths = lengths.to(device)  # (n, E): an entry's shortest alternative
        self.bit = (1 << torch.arange(min(entries, EXACT_ENTRIES), device=device)).long()
        letters = max([len(a) for a in alphabets] + [1])
        self.alphabet = torch.full((len(sentences), letters), -1, dtype=torch.long)  # (n, G)
        for s, tokens in enumerate(alphabets):
            self.alphabet[s, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        self.alphabet = self.alphabet.to(device)
        # Above every bank: all entries' tokens and the deepest node.
        self.banks = int(lengths.sum(dim=1).max()) + max(depth) + 1

    def step(self, node: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The node after each of `tokens` (r, K) from `node` (r,)."""
        if len(self.keys) == 0:
            return self.root_of[node][:, None].expand_as(tokens)
        key = node[:, None] * self.vocab + tokens.clamp(min=0)
        at = torch.searchsorted(self.keys, key).clamp(max=len(self.keys) - 1)
        return torch.where(self.keys[at] == key, self.values[at], self.root_of[node][:, None])

    def progress(
        self, sentence: torch.Tensor, node: torch.Tensor, met: torch.Tensor
    ) -> torch.Tensor:
        """Tokens of progress (bank) of each candidate: sentence, node (...), met (..., E)."""
        real, lengths = self.real[sentence], self.lengths[sentence]
        done = (met & real).long().mul(lengths).sum(dim=-1)
        partial = (self.starts[node] & ~met & real).any(dim=-1)
        return done + torch.where(partial, self.depth[node], 0)

    def needed(self, sentence: torch.Tensor, node: torch.Tensor, met: torch.Tensor) -> torch.Tensor:
        """Tokens still to write at least before every entry is met (EOS excluded), for each
        state: sentence, node (...), met (..., E) of the same shape (the module docstring)."""
        real, lengths = self.real[sentence], self.lengths[sentence]
        open_ = real & ~met  # (..., E)
        unmet = open_.long().mul(lengths).sum(dim=-1)
        saved = (lengths - self.to_finish[node]).masked_fill(~open_, 0).amax(dim=-1).clamp(min=0)
        estimate = unmet - saved
        mask = (met[..., : len(self.bit)].long() * self.bit).sum(dim=-1)
        exact = self.distance[node, mask]
        return torch.where(self.exact[sentence], exact, estimate)


class _Node:
    def __init__(self, index: int, depth: int) -> None:
        self.index, self.depth = index, depth
        self.children: dict[int, int] = {}
        self.delta: dict[int, int] = {}  # token -> node, where not the root
        self.completes: set[int] = set()  # entries an alternative of which ends here
        self.starts: set[int] = set()  # entries an alternative of which begins with this node
        self.to_finish: dict[int, int] = {}  # entry -> tokens to the end of its nearest one
        self.fail = 0


def _automaton(terms: Terms) -> list[_Node]:
    """One sentence's Aho-Corasick automaton over its entries' alternatives (node 0: the root):
    goto, failure links, the full transition function over the alternatives' tokens, and at each
    node the entries it completes (its own and its failure chain's)."""
    nodes = [_Node(0, 0)]
    for entry, alternatives in enumerate(terms):
        for alternative in alternatives:
            at = nodes[0]
            for token in alternative:
                if token not in at.children:
                    nodes.append(_Node(len(nodes), at.depth + 1))
                    at.children[token] = nodes[-1].index
                at = nodes[at.children[token]]
                at.starts.add(entry)
                rest = len(alternative) - at.depth
                at.to_finish[entry] = min(at.to_finish.get(entry, rest), rest)
            at.completes.add(entry)
    alphabet = sorted({t for alternatives in terms for a in alternatives for t in a})
    queue = [0]
    for u in queue:  # breadth first: a node's failure is shallower, so done before it
        node = nodes[u]
        if u:
            node.completes |= nodes[node.fail].completes
        for token in alphabet:
            if token in node.children:
                target = node.children[token]
                nodes[target].fail = nodes[node.fail].delta.get(token, 0) if u else 0
                queue.append(target)
            else:
                target = nodes[node.fail].delta.get(token, 0) if u else 0
            if target:
                node.delta[token] = target
    return nodes


def _distances(nodes: list[_Node], entries: int, alphabet: list[int]) -> np.ndarray:
    """(nodes, 2^entries) the fewest tokens that take each (node, met entries) to every entry
    met: Bellman's iteration d(s) = 1 + min over tokens of d(next s), from d = 0 at the goal (a
    token outside the alphabet leads to the root, with the same entries met)."""
    full = (1 << entries) - 1
    masks = np.arange(full + 1)
    following = np.zeros((len(nodes), len(alphabet) + 1), dtype=np.int64)  # + the root's move
    completes = np.zeros(len(nodes), dtype=np.int64)
    for node in nodes:
        completes[node.index] = sum(1 << e for e in node.completes)
        following[node.index, :-1] = [node.delta.get(t, 0) for t in alphabet]
    after = masks[None, None, :] | completes[following][:, :, None]  # (nodes, A + 1, masks)
    distance = np.full((len(nodes), full + 1), _FAR, dtype=np.int64)
    distance[:, full] = 0
    for _ in range(len(nodes) * (entries + 1) + 1):  # a shortest path visits each state once
        through = distance[following[:, :, None], after].min(axis=1) + 1  # (nodes, masks)
        improved = np.minimum(distance, through)
        if np.array_equal(improved, distance):
            break
        distance = improved
    return np.minimum(distance, _FAR)


def _bits(sets: list[set[int]], width: int, device: torch.device | str) -> torch.Tensor:
    out = torch.zeros(len(sets), width, dtype=torch.bool)
    for row, members in enumerate(sets):
        out[row, list(members)] = True
    return out.to(device)
