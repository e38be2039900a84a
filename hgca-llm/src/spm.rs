//! SentencePiece-style BPE from a GGUF vocabulary with scores
//! (`tokenizer.ggml.model = llama`, as Gemma ships it): spaces become
//! `▁` (U+2581), adjacent pieces are merged best score first while the
//! merged string is in the vocabulary, and characters no piece holds fall
//! back to their UTF-8 bytes (`<0xXX>` tokens). Control and user-defined
//! tokens are matched whole in the raw text before that, longest first.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// GGUF token types.
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const BYTE: i32 = 6;

/// The vocabulary of a SentencePiece BPE tokenizer.
#[derive(Debug, Clone)]
pub(crate) struct Spm {
    tokens: Vec<String>,
    scores: Vec<f32>,
    ids: HashMap<String, u32>,
    /// `<0xXX>` tokens by byte value, and the byte of each.
    bytes: [Option<u32>; 256],
    byte_of: HashMap<u32, u8>,
    unk: Option<u32>,
    /// Control and user-defined tokens by their first byte, longest first.
    specials: HashMap<u8, Vec<u32>>,
}

/// A candidate merge of the symbols `left` and `right` (indices into the
/// symbol list), ordered best score first, then leftmost.
#[derive(Debug, PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    fn cmp(&self, o: &Self) -> Ordering {
        self.score
            .total_cmp(&o.score)
            .then_with(|| o.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

/// A symbol of the word being merged: a byte range of the text, linked to
/// its neighbours (`usize::MAX` for none); `len == 0` once merged away.
#[derive(Debug, Clone, Copy)]
struct Sym {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

const NONE: usize = usize::MAX;

impl Spm {
    /// The tokenizer of `tokens` with their `scores` and GGUF `types`.
    pub(crate) fn new(
        tokens: Vec<String>,
        scores: Vec<f32>,
        types: &[i32],
        unk: Option<u32>,
    ) -> Self {
        let ids = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let mut bytes = [None; 256];
        let mut specials: HashMap<u8, Vec<u32>> = HashMap::new();
        for (i, (t, &ty)) in tokens.iter().zip(types).enumerate() {
            if ty == BYTE {
                let hex = t.strip_prefix("<0x").and_then(|h| h.strip_suffix('>'));
                if let Some(b) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    bytes[usize::from(b)] = Some(i as u32);
                }
            } else if (ty == CONTROL || ty == USER_DEFINED) && !t.is_empty() {
                specials.entry(t.as_bytes()[0]).or_default().push(i as u32);
            }
        }
        for list in specials.values_mut() {
            list.sort_by_key(|&i| std::cmp::Reverse(tokens[i as usize].len()));
        }
        let byte_of = (0..=255u8)
            .filter_map(|b| bytes[usize::from(b)].map(|id| (id, b)))
            .collect();
        Self {
            tokens,
            scores,
            ids,
            bytes,
            byte_of,
            unk,
            specials,
        }
    }

    /// The piece of `id`.
    pub(crate) fn piece(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The id of a piece.
    pub(crate) fn id(&self, piece: &str) -> Option<u32> {
        self.ids.get(piece).copied()
    }

    /// Appends the ids of `text` to `out`.
    pub(crate) fn encode(&self, text: &str, out: &mut Vec<u32>) {
        let b = text.as_bytes();
        let (mut i, mut plain) = (0, 0);
        while i < b.len() {
            let hit = self.specials.get(&b[i]).and_then(|list| {
                list.iter()
                    .copied()
                    .find(|&id| b[i..].starts_with(self.tokens[id as usize].as_bytes()))
            });
            match hit {
                // A special's first byte is where a character starts (it
                // is a whole string), so `i` is a char boundary.
                Some(id) if text.is_char_boundary(i) => {
                    self.encode_plain(&text[plain..i], out);
                    out.push(id);
                    i += self.tokens[id as usize].len();
                    plain = i;
                }
                _ => i += 1,
            }
        }
        self.encode_plain(&text[plain..], out);
    }

    /// SentencePiece BPE of text holding no special token.
    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        let text = text.replace(' ', "\u{2581}");
        let mut syms: Vec<Sym> = Vec::new();
        for (k, (start, c)) in text.char_indices().enumerate() {
            syms.push(Sym {
                start,
                len: c.len_utf8(),
                prev: if k == 0 { NONE } else { k - 1 },
                next: k + 1,
            });
        }
        if let Some(last) = syms.last_mut() {
            last.next = NONE;
        }
        let mut heap = BinaryHeap::new();
        let add = |heap: &mut BinaryHeap<Bigram>, syms: &[Sym], l: usize, r: usize| {
            if l == NONE || r == NONE {
                return;
            }
            let (a, b) = (syms[l], syms[r]);
            let s = &text[a.start..b.start + b.len];
            if let Some(&id) = self.ids.get(s) {
                heap.push(Bigram {
                    score: self.scores[id as usize],
                    left: l,
                    right: r,
                    len: s.len(),
                });
            }
        };
        for k in 1..syms.len() {
            add(&mut heap, &syms, k - 1, k);
        }
        while let Some(g) = heap.pop() {
            let (l, r) = (syms[g.left], syms[g.right]);
            // Stale: one side merged since, or grown.
            if l.len == 0 || r.len == 0 || l.len + r.len != g.len || l.next != g.right {
                continue;
            }
            syms[g.left].len += r.len;
            syms[g.left].next = r.next;
            syms[g.right].len = 0;
            if r.next != NONE {
                syms[r.next].prev = g.left;
            }
            add(&mut heap, &syms, l.prev, g.left);
            add(&mut heap, &syms, g.left, syms[g.left].next);
        }
        let mut k = if syms.is_empty() { NONE } else { 0 };
        while k != NONE {
            let s = syms[k];
            let piece = &text[s.start..s.start + s.len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &byte in piece.as_bytes() {
                        out.extend(self.bytes[usize::from(byte)].or(self.unk));
                    }
                }
            }
            k = s.next;
        }
    }

    /// The text of `ids`: `▁` back to spaces, byte tokens to their bytes
    /// (invalid UTF-8 replaced), other pieces as they are.
    pub(crate) fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            let Some(t) = self.tokens.get(id as usize) else {
                continue;
            };
            if let Some(&b) = self.byte_of.get(&id) {
                bytes.push(b);
            } else {
                bytes.extend_from_slice(t.replace('\u{2581}', " ").as_bytes());
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small vocabulary: merges by score, byte fallback, specials.
    fn vocab() -> Spm {
        let t = [
            ("<unk>", 0.0, 2),
            ("<bos>", 0.0, CONTROL),
            ("<start_of_turn>", 0.0, CONTROL),
            ("\n", 0.0, USER_DEFINED),
            ("\n\n", 0.0, USER_DEFINED),
            ("<0xC3>", 0.0, BYTE),
            ("<0xA9>", 0.0, BYTE),
            ("<0x21>", 0.0, BYTE),
            ("\u{2581}", -10.0, 1),
            ("h", -11.0, 1),
            ("e", -12.0, 1),
            ("l", -13.0, 1),
            ("o", -14.0, 1),
            ("he", -3.0, 1),
            ("ll", -2.0, 1),
            ("llo", -4.0, 1),
            ("hello", -1.0, 1),
            ("\u{2581}h", -5.0, 1),
            ("el", -0.5, 1),
        ];
        let (tokens, rest): (Vec<String>, Vec<(f32, i32)>) = t
            .iter()
            .map(|&(s, sc, ty)| (s.to_owned(), (sc, ty)))
            .unzip();
        let (scores, types): (Vec<f32>, Vec<i32>) = rest.into_iter().unzip();
        Spm::new(tokens, scores, &types, Some(0))
    }

    fn enc<'a>(s: &'a Spm, text: &str) -> Vec<&'a str> {
        let mut ids = Vec::new();
        s.encode(text, &mut ids);
        ids.iter().map(|&i| s.piece(i).unwrap()).collect()
    }

    #[test]
    fn merges_best_score_first() {
        let s = vocab();
        // "el" (-0.5) beats "ll" (-2) and "he" (-3); then no piece holds
        // "hel" or "ell", so h, el, l, o stay apart except where a piece does.
        assert_eq!(enc(&s, "hello"), ["h", "el", "l", "o"]);
        // Without an "e": "ll" first, then "llo"; no piece holds "hllo".
        assert_eq!(enc(&s, "hllo"), ["h", "llo"]);
    }

    #[test]
    fn spaces_specials_and_byte_fallback() {
        let s = vocab();
        assert_eq!(enc(&s, " h"), ["\u{2581}h"]);
        assert_eq!(
            enc(&s, "<start_of_turn>o\n\n\no"),
            ["<start_of_turn>", "o", "\n\n", "\n", "o"]
        );
        // 'é' is not a piece: its two UTF-8 bytes; '!' likewise.
        assert_eq!(enc(&s, "é!"), ["<0xC3>", "<0xA9>", "<0x21>"]);
        // A character with no byte token either: unknown.
        assert_eq!(enc(&s, "z"), ["<unk>"]);
    }

    #[test]
    fn decode_inverts_encode() {
        let s = vocab();
        for text in ["hello", " hello\n\nhe é!", "<start_of_turn>h el"] {
            let mut ids = Vec::new();
            s.encode(text, &mut ids);
            assert_eq!(s.decode(&ids), text);
        }
    }
}
