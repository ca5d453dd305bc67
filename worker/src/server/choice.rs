//! One choice of a completion as it is generated: its text (stop strings cut it, across token
//! boundaries), its tokens with their log-probabilities and where each starts in the text, and
//! what part of it a stream may already send.

use kvgate_proto::logprobs::TokenLogprobs;

use crate::engine::FinishReason;
use crate::tokenizer::{StreamDecoder, Tokenizer, TokenizerError};

/// A generated token: its id, where its text starts in the choice's text, its log-probabilities.
#[derive(Debug, Clone)]
pub struct Scored {
    pub id: u32,
    pub offset: usize,
    pub logprobs: Option<TokenLogprobs>,
}

#[derive(Debug)]
pub struct Choice {
    stops: Vec<String>,
    decoder: StreamDecoder,
    pub text: String,
    pub tokens: Vec<Scored>,
    /// Tokens the model generated for this choice (a stop string may hide some of them).
    pub generated: usize,
    pub finish: Option<FinishReason>,
    /// Bytes of `text` and entries of `tokens` a stream has sent.
    sent_text: usize,
    sent_tokens: usize,
}

impl Choice {
    pub fn new(stops: Vec<String>) -> Self {
        Choice { stops, decoder: StreamDecoder::default(), text: String::new(), tokens: Vec::new(), generated: 0, finish: None, sent_text: 0, sent_tokens: 0 }
    }

    /// Adds a generated token; true when a stop string has now ended the choice (the caller
    /// stops generating).
    pub fn push(&mut self, tok: &Tokenizer, id: u32, logprobs: Option<TokenLogprobs>) -> Result<bool, TokenizerError> {
        self.generated += 1;
        let offset = self.text.len();
        self.text.push_str(&self.decoder.push(tok, id)?);
        self.tokens.push(Scored { id, offset, logprobs });
        Ok(self.cut_at_stop(offset))
    }

    /// The engine is done with this choice.
    pub fn end(&mut self, tok: &Tokenizer, reason: FinishReason) -> Result<(), TokenizerError> {
        if self.finish.is_none() {
            let offset = self.text.len();
            self.text.push_str(&self.decoder.finish(tok)?);
            if !self.cut_at_stop(offset) {
                self.finish = Some(reason);
            }
        }
        Ok(())
    }

    /// Looks for a stop string that may end in the text added at `from`; cuts the text before
    /// it and drops the tokens that start inside it.
    fn cut_at_stop(&mut self, from: usize) -> bool {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let mut start = from.saturating_sub(longest.saturating_sub(1));
        while !self.text.is_char_boundary(start) {
            start -= 1;
        }
        let Some(at) = self.stops.iter().filter_map(|s| self.text[start..].find(s.as_str()).map(|i| start + i)).min() else { return false };
        self.text.truncate(at);
        self.tokens.retain(|t| t.offset < at);
        self.finish = Some(FinishReason::Stop);
        true
    }

    /// What a stream may send now: text that can no longer turn out to begin a stop string, and
    /// the tokens that start in it.
    pub fn take_ready(&mut self) -> (String, Vec<Scored>) {
        // Hold back the longest end of the text that a stop string begins with.
        let held = |stop: &String| (1..stop.len()).rev().find(|k| stop.is_char_boundary(*k) && self.text.ends_with(&stop[..*k])).unwrap_or(0);
        let hold = if self.finish.is_some() { 0 } else { self.stops.iter().map(held).max().unwrap_or(0) };
        let mut end = self.text.len().saturating_sub(hold).max(self.sent_text);
        while !self.text.is_char_boundary(end) {
            end -= 1;
        }
        let text = self.text[self.sent_text..end].to_string();
        self.sent_text = end;
        let ready = self.tokens[self.sent_tokens..].iter().take_while(|t| t.offset < end || (self.finish.is_some())).count();
        let tokens = self.tokens[self.sent_tokens..self.sent_tokens + ready].to_vec();
        self.sent_tokens += ready;
        (text, tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(stops: &[&str], pieces: &[u8]) -> Choice {
        let mut c = Choice::new(stops.iter().map(|s| s.to_string()).collect());
        for b in pieces {
            if c.push(&Tokenizer::Bytes, *b as u32, None).unwrap() {
                break;
            }
        }
        c
    }

    #[test]
    fn a_stop_string_split_across_tokens_cuts_the_text_before_it() {
        let c = feed(&["\n\n", "END"], b"one\ntwo EN");
        assert_eq!((c.text.as_str(), c.finish), ("one\ntwo EN", None));
        let c = feed(&["\n\n", "END"], b"one\ntwo ENDthree");
        assert_eq!((c.text.as_str(), c.finish), ("one\ntwo ", Some(FinishReason::Stop)));
        assert_eq!(c.tokens.len(), 8, "tokens of the stop string are not reported");
        assert_eq!(c.generated, 11);
    }

    #[test]
    fn a_stream_holds_back_what_may_begin_a_stop_string() {
        let mut c = feed(&["END"], b"abcEN");
        assert_eq!(c.take_ready().0, "abc");
        c.push(&Tokenizer::Bytes, b'x' as u32, None).unwrap();
        assert_eq!(c.take_ready().0, "ENx");
        c.push(&Tokenizer::Bytes, b'y' as u32, None).unwrap();
        c.end(&Tokenizer::Bytes, FinishReason::Length).unwrap();
        assert_eq!(c.take_ready().0, "y");
    }
}
