//! A GGUF's SentencePiece vocabulary (`tokenizer.ggml.model = llama`: Llama 2, Mistral,
//! TinyLlama), tokenized as llama.cpp does it, so both agree on the ids of a text: spaces become
//! `▁` (and one is put in front), the text starts as single characters, and the adjacent pair
//! whose joined piece has the highest score is merged while one is in the vocabulary; a
//! character the vocabulary lacks is spelled by its UTF-8 bytes (`<0xXX>` pieces).

use std::collections::{BinaryHeap, HashMap};

use candle_core::quantized::gguf_file::Value;

use super::TokenizerError;

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
const CONTROL: i32 = 3;
const BYTE: i32 = 6;

#[derive(Debug)]
pub struct Spm {
    pieces: Vec<String>,
    scores: Vec<f32>,
    types: Vec<i32>,
    ids: HashMap<String, u32>,
    bytes: [Option<u32>; 256],
    bos: Option<u32>,
    add_bos: bool,
    add_space_prefix: bool,
}

/// A candidate merge: the joined piece's score, then the leftmost first.
#[derive(PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    len: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.score.total_cmp(&other.score).then(other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// A symbol of the text being merged: a byte range, linked to its neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Spm {
    pub fn new(pieces: Vec<String>, scores: Vec<f32>, types: Vec<i32>, bos: Option<u32>, add_bos: bool, add_space_prefix: bool) -> Result<Spm, TokenizerError> {
        if scores.len() != pieces.len() || types.len() != pieces.len() {
            return Err(TokenizerError(format!("GGUF tokenizer: {} tokens but {} scores and {} token types", pieces.len(), scores.len(), types.len())));
        }
        let ids: HashMap<String, u32> = pieces.iter().enumerate().map(|(i, p)| (p.clone(), i as u32)).collect();
        let mut bytes = [None; 256];
        for (b, slot) in bytes.iter_mut().enumerate() {
            *slot = ids.get(&format!("<0x{b:02X}>")).copied();
        }
        Ok(Spm { pieces, scores, types, ids, bytes, bos, add_bos, add_space_prefix })
    }

    /// The vocabulary a GGUF file's `tokenizer.ggml.*` metadata describes (scores 0 and normal
    /// types where the file gives none, BOS added and a space put in front unless it says not).
    pub fn from_gguf(m: &HashMap<String, Value>) -> Result<Spm, TokenizerError> {
        let err = |k: &str, e: candle_core::Error| TokenizerError(format!("`{k}`: {e}"));
        let list = |k: &str| m.get(k).map(|v| v.to_vec().map_err(|e| err(k, e))).transpose();
        let Some(tokens) = list("tokenizer.ggml.tokens")? else { return Err(TokenizerError("GGUF metadata: missing `tokenizer.ggml.tokens`".into())) };
        let pieces = tokens.iter().map(|v| v.to_string().cloned()).collect::<Result<Vec<_>, _>>().map_err(|e| err("tokenizer.ggml.tokens", e))?;
        let scores = list("tokenizer.ggml.scores")?.map_or_else(|| vec![0.0; pieces.len()], |s| s.iter().map(|s| s.to_f32().unwrap_or(0.0)).collect());
        let types = list("tokenizer.ggml.token_type")?.map_or_else(|| vec![1; pieces.len()], |t| t.iter().map(|t| t.to_i32().unwrap_or(1)).collect());
        let flag = |k: &str, default: bool| m.get(k).map_or(Ok(default), |v| v.to_bool().map_err(|e| err(k, e)));
        let bos = m.get("tokenizer.ggml.bos_token_id").and_then(|v| v.to_u32().ok());
        Spm::new(pieces, scores, types, bos, flag("tokenizer.ggml.add_bos_token", true)?, flag("tokenizer.ggml.add_space_prefix", true)?)
    }

    pub fn token(&self, id: u32) -> Option<String> {
        self.pieces.get(id as usize).cloned()
    }

    /// `special`: put BOS first when the file says to.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::new();
        if special && self.add_bos {
            out.extend(self.bos);
        }
        if text.is_empty() {
            return Ok(out);
        }
        let spaced = format!("{}{}", if self.add_space_prefix { " " } else { "" }, text).replace(' ', "\u{2581}");
        let mut symbols: Vec<Symbol> = spaced.char_indices().map(|(i, c)| Symbol { start: i, len: c.len_utf8(), prev: None, next: None }).collect();
        let n = symbols.len();
        for (i, s) in symbols.iter_mut().enumerate() {
            s.prev = i.checked_sub(1);
            s.next = (i + 1 < n).then_some(i + 1);
        }
        let mut queue = BinaryHeap::new();
        for i in 0..n.saturating_sub(1) {
            self.propose(&spaced, &symbols, i, i + 1, &mut queue);
        }
        while let Some(b) = queue.pop() {
            let left = b.left;
            let Some(right) = symbols[left].next else { continue };
            // Stale: one side was merged into something else since it was proposed.
            if symbols[left].len == 0 || symbols[left].len + symbols[right].len != b.len {
                continue;
            }
            symbols[left].len += symbols[right].len;
            symbols[right].len = 0;
            symbols[left].next = symbols[right].next;
            if let Some(next) = symbols[right].next {
                symbols[next].prev = Some(left);
            }
            if let Some(prev) = symbols[left].prev {
                self.propose(&spaced, &symbols, prev, left, &mut queue);
            }
            if let Some(next) = symbols[left].next {
                self.propose(&spaced, &symbols, left, next, &mut queue);
            }
        }
        let mut at = Some(0);
        while let Some(i) = at {
            let s = symbols[i];
            let piece = &spaced[s.start..s.start + s.len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for b in piece.bytes() {
                        out.push(self.bytes[b as usize].ok_or_else(|| TokenizerError(format!("GGUF tokenizer: no piece for byte 0x{b:02X} of {piece:?}")))?);
                    }
                }
            }
            at = s.next;
        }
        Ok(out)
    }

    fn propose(&self, text: &str, symbols: &[Symbol], left: usize, right: usize, queue: &mut BinaryHeap<Bigram>) {
        let (l, r) = (symbols[left], symbols[right]);
        let joined = &text[l.start..r.start + r.len];
        if let Some(&id) = self.ids.get(joined) {
            queue.push(Bigram { score: self.scores[id as usize], left, len: joined.len() });
        }
    }

    /// The text of `ids`; control tokens (BOS, EOS) are left out, and the space put in front
    /// of the text is taken off again.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let mut bytes = Vec::new();
        for &id in ids {
            let Some(piece) = self.pieces.get(id as usize) else { return Err(TokenizerError(format!("token id {id} is outside the vocabulary"))) };
            match self.types[id as usize] {
                CONTROL => {}
                BYTE => match u8::from_str_radix(piece.trim_start_matches("<0x").trim_end_matches('>'), 16) {
                    Ok(b) => bytes.push(b),
                    Err(_) => bytes.extend_from_slice(piece.as_bytes()),
                },
                _ => bytes.extend_from_slice(piece.replace('\u{2581}', " ").as_bytes()),
            }
        }
        let text = String::from_utf8_lossy(&bytes).into_owned();
        Ok(match text.strip_prefix(' ') {
            Some(rest) if self.add_space_prefix => rest.to_string(),
            _ => text,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary where `▁h`, `el`, `lo` and `ello` exist with scores that decide the merges.
    fn spm() -> Spm {
        let mut pieces: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
        pieces.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
        let words = [
            ("\u{2581}", -1.0),
            ("h", -2.0),
            ("e", -2.0),
            ("l", -2.0),
            ("o", -2.0),
            ("\u{2581}h", -3.0),
            ("el", -5.0),
            ("lo", -4.0),
            ("ello", -6.0),
            ("ll", -9.0),
        ];
        let mut scores = vec![0.0; pieces.len()];
        let mut types = vec![CONTROL, CONTROL, CONTROL];
        types.extend([BYTE; 256]);
        for (w, s) in words {
            pieces.push(w.into());
            scores.push(s);
            types.push(1);
        }
        types[0] = 2;
        Spm::new(pieces, scores, types, Some(1), true, true).unwrap()
    }

    fn piece(s: &Spm, ids: &[u32]) -> Vec<String> {
        ids.iter().map(|&i| s.token(i).unwrap()).collect()
    }

    #[test]
    fn the_best_scoring_pair_merges_first_and_unknown_characters_are_spelled_in_bytes() {
        let s = spm();
        // "▁hello": ▁h (-3), then lo (-4), then el (-5), then what those two make, ello (-6);
        // ll (-9) lost its turn when lo took its second l.
        let ids = s.encode("hello", true).unwrap();
        assert_eq!(piece(&s, &ids), ["<s>", "\u{2581}h", "ello"]);
        // é is not in the vocabulary: its two UTF-8 bytes.
        let ids = s.encode("hé", false).unwrap();
        assert_eq!(piece(&s, &ids), ["\u{2581}h", "<0xC3>", "<0xA9>"]);
        assert_eq!(s.decode(&ids).unwrap(), "hé");
    }

    #[test]
    fn decoding_leaves_out_control_tokens_and_the_leading_space() {
        let s = spm();
        let ids = s.encode("hello hello", true).unwrap();
        assert_eq!(ids[0], 1);
        assert_eq!(s.decode(&ids).unwrap(), "hello hello");
        assert!(s.decode(&[9999]).unwrap_err().to_string().contains("outside the vocabulary"));
    }
}
