//! Places held per key (a client's address, an API key) under a cap per key and a total cap:
//! what requests in flight per client are (connections have `places.rs`). A place is given back when its
//! [`Share`] is dropped, however the work that held it ends.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

/// Which cap a refused place hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Full {
    /// Every place is held.
    Total,
    /// This key holds its share.
    Key,
}

#[derive(Debug)]
pub struct Shares<K> {
    total: usize,
    per_key: usize,
    held: Mutex<(usize, HashMap<K, usize>)>,
}

/// One place, given back when dropped.
#[derive(Debug)]
pub struct Share<K: Hash + Eq> {
    owner: Arc<Shares<K>>,
    key: K,
}

impl<K: Hash + Eq + Clone> Shares<K> {
    pub fn new(total: usize, per_key: usize) -> Arc<Self> {
        Arc::new(Shares { total, per_key, held: Mutex::new((0, HashMap::new())) })
    }

    pub fn take(self: &Arc<Self>, key: K) -> Result<Share<K>, Full> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let (total, by_key) = &mut *held;
        if *total >= self.total {
            return Err(Full::Total);
        }
        let mine = by_key.entry(key.clone()).or_default();
        if *mine >= self.per_key {
            return Err(Full::Key);
        }
        *mine += 1;
        *total += 1;
        Ok(Share { owner: self.clone(), key })
    }

    /// The most places one key may hold.
    pub fn per_key(&self) -> usize {
        self.per_key
    }

    /// Places held now (all keys).
    pub fn held(&self) -> usize {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).0
    }
}

impl<K: Hash + Eq> Drop for Share<K> {
    fn drop(&mut self) {
        let mut held = self.owner.held.lock().unwrap_or_else(|p| p.into_inner());
        let (total, by_key) = &mut *held;
        *total -= 1;
        if let Some(n) = by_key.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                by_key.remove(&self.key); // no entry left behind per key ever seen
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_gets_its_share_the_total_caps_all_and_places_come_back() {
        let shares = Shares::new(3, 2);
        let a1 = shares.take("a").unwrap();
        let _a2 = shares.take("a").unwrap();
        assert_eq!(shares.take("a").unwrap_err(), Full::Key);
        let b1 = shares.take("b").unwrap();
        assert_eq!(shares.take("b").unwrap_err(), Full::Total);
        drop(a1);
        assert!(shares.take("b").is_ok(), "a freed place serves anyone");
        drop(b1);
        assert_eq!(shares.held(), 1);
        assert_eq!(shares.held.lock().unwrap().1.len(), 1, "keys with nothing held are forgotten");
    }
}
