//! Places held per key (a client's address, an API key) under a cap per key: what requests in
//! flight per client are (connections have `listener/places.rs`). A place is given back when its
//! [`Share`] is dropped, however the work that held it ends.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

/// The key holds its share already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full;

#[derive(Debug)]
pub struct Shares<K> {
    per_key: usize,
    held: Mutex<HashMap<K, usize>>,
}

/// One place, given back when dropped.
#[derive(Debug)]
pub struct Share<K: Hash + Eq> {
    owner: Arc<Shares<K>>,
    key: K,
}

impl<K: Hash + Eq + Clone> Shares<K> {
    pub fn new(per_key: usize) -> Arc<Self> {
        Arc::new(Shares { per_key, held: Mutex::new(HashMap::new()) })
    }

    pub fn take(self: &Arc<Self>, key: K) -> Result<Share<K>, Full> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let mine = held.entry(key.clone()).or_default();
        if *mine >= self.per_key {
            return Err(Full);
        }
        *mine += 1;
        Ok(Share { owner: self.clone(), key })
    }

    /// The most places one key may hold.
    pub fn per_key(&self) -> usize {
        self.per_key
    }
}

impl<K: Hash + Eq> Drop for Share<K> {
    fn drop(&mut self) {
        let mut held = self.owner.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = held.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.key); // no entry left behind per key ever seen
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_gets_its_share_and_places_come_back() {
        let shares = Shares::new(2);
        let a1 = shares.take("a").unwrap();
        let _a2 = shares.take("a").unwrap();
        assert_eq!(shares.take("a").unwrap_err(), Full);
        let b1 = shares.take("b").unwrap();
        drop(a1);
        assert!(shares.take("a").is_ok(), "a freed place serves its key again");
        drop(b1);
        assert_eq!(shares.held.lock().unwrap().len(), 1, "keys with nothing held are forgotten");
    }
}
