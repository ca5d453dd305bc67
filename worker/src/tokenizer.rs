//! Text <-> token ids: the tiny model's byte-level tokenizer, a checkpoint's `tokenizer.json`,
//! or the vocabulary a GGUF file carries (a byte-level BPE as `tokenizers` builds it, or a
//! SentencePiece vocabulary, `spm`).

mod spm;

use std::path::Path;
use std::sync::Arc;

/// A tokenizer that could not be loaded, or text or ids it could not convert.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TokenizerError(String);

/// The byte tokenizer's begin-of-sequence id (bytes are 0..=255).
pub const BOS: u32 = 256;
/// The byte tokenizer's end-of-sequence id.
pub const EOS: u32 = 257;

pub enum Tokenizer {
    /// One token per byte, with BOS prepended.
    Bytes,
    Hf(Box<tokenizers::Tokenizer>),
    Spm(Box<spm::Spm>),
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Tokenizer::Bytes => "Tokenizer::Bytes",
            Tokenizer::Hf(_) => "Tokenizer::Hf",
            Tokenizer::Spm(_) => "Tokenizer::Spm",
        })
    }
}

impl Tokenizer {
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        let t = tokenizers::Tokenizer::from_file(path).map_err(|e| TokenizerError(format!("{}: {e}", path.display())))?;
        Ok(Tokenizer::Hf(Box::new(t)))
    }

    /// The tokenizer a GGUF file's metadata describes (`tokenizer.ggml.*`).
    pub fn from_gguf(content: &candle_core::quantized::gguf_file::Content) -> Result<Self, TokenizerError> {
        let model = content.metadata.get("tokenizer.ggml.model").ok_or_else(|| TokenizerError("GGUF metadata: missing `tokenizer.ggml.model`".into()))?;
        let model = model.to_string().map_err(|e| TokenizerError(format!("`tokenizer.ggml.model`: {e}")))?;
        match model.as_str() {
            "gpt2" => {
                use candle_core::quantized::tokenizer::TokenizerFromGguf;
                let t = tokenizers::Tokenizer::from_gguf(content).map_err(|e| TokenizerError(format!("GGUF byte-level BPE vocabulary: {e}")))?;
                Ok(Tokenizer::Hf(Box::new(t)))
            }
            "llama" => Ok(Tokenizer::Spm(Box::new(spm::Spm::from_gguf(&content.metadata)?))),
            other => Err(TokenizerError(format!("GGUF metadata `tokenizer.ggml.model` = {other:?}: not implemented (gpt2, llama)"))),
        }
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.encode_with(text, true)
    }

    /// `special`: add what the tokenizer adds around a text (the byte tokenizer's BOS).
    pub fn encode_with(&self, text: &str, special: bool) -> Result<Vec<u32>, TokenizerError> {
        match self {
            Tokenizer::Bytes => Ok(special.then_some(BOS).into_iter().chain(text.bytes().map(u32::from)).collect()),
            Tokenizer::Hf(t) => Ok(t.encode(text, special).map_err(|e| TokenizerError(e.to_string()))?.get_ids().to_vec()),
            Tokenizer::Spm(s) => s.encode(text, special),
        }
    }

    /// The vocabulary entry of `id` (a checkpoint's tokenizer; the byte tokenizer has none).
    pub fn token(&self, id: u32) -> Option<String> {
        match self {
            Tokenizer::Bytes => None,
            Tokenizer::Hf(t) => t.id_to_token(id),
            Tokenizer::Spm(s) => s.token(id),
        }
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        match self {
            Tokenizer::Bytes => {
                let bytes: Vec<u8> = ids.iter().filter(|&&id| id < 256).map(|&id| id as u8).collect();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Tokenizer::Hf(t) => t.decode(ids, true).map_err(|e| TokenizerError(e.to_string())),
            Tokenizer::Spm(s) => s.decode(ids),
        }
    }
}

/// Whole texts are encoded and decoded on tokio's blocking pool: a long prompt takes
/// milliseconds, which on an async worker thread would stall every connection it serves. (A
/// generated token's piece, a few bytes through `StreamDecoder`, stays where it is.)
pub async fn encode_off_runtime(tokenizer: &Arc<Tokenizer>, text: String, special: bool) -> Result<Vec<u32>, TokenizerError> {
    let t = Arc::clone(tokenizer);
    off_runtime(move || t.encode_with(&text, special)).await
}

pub async fn decode_off_runtime(tokenizer: &Arc<Tokenizer>, ids: Vec<u32>) -> Result<String, TokenizerError> {
    let t = Arc::clone(tokenizer);
    off_runtime(move || t.decode(&ids)).await
}

async fn off_runtime<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(work).await.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
}

/// Turns a growing list of generated ids into text pieces that concatenate to the full decode,
/// holding back a trailing partial character until the bytes that finish it arrive.
#[derive(Debug, Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    emitted: usize,
}

impl StreamDecoder {
    /// Adds one id; returns the newly complete text (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        self.ids.push(id);
        let text = tok.decode(&self.ids)?;
        if text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        Ok(self.take_from(text))
    }

    /// Whatever is still held back, at the end of generation.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String, TokenizerError> {
        let text = tok.decode(&self.ids)?;
        Ok(self.take_from(text))
    }

    fn take_from(&mut self, text: String) -> String {
        let piece = text.get(self.emitted..).unwrap_or("").to_string();
        self.emitted = text.len();
        piece
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_with_bos() {
        let t = Tokenizer::Bytes;
        let ids = t.encode("héllo").unwrap();
        assert_eq!(ids[0], BOS);
        assert_eq!(ids.len(), 1 + "héllo".len());
        assert_eq!(t.decode(&ids).unwrap(), "héllo");
    }

    #[test]
    fn stream_pieces_concatenate_to_the_whole_text() {
        let t = Tokenizer::Bytes;
        let ids: Vec<u32> = "aé€b".bytes().map(u32::from).collect();
        let mut d = StreamDecoder::default();
        let mut pieces = Vec::new();
        for id in &ids {
            pieces.push(d.push(&t, *id).unwrap());
        }
        pieces.push(d.finish(&t).unwrap());
        assert_eq!(pieces.concat(), "aé€b");
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
    }
}
