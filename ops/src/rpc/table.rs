//! The endpoint's sessions by number. A session number is a slot index and
//! the slot's generation: a closed session's slot is reused by the next
//! session, with the next generation, so connecting and disconnecting
//! forever keeps the table as large as the most sessions open at once, and
//! a late packet for the closed session (its old number) finds nothing.

use super::session::Session;

/// Bits of a session number that index the table.
const INDEX_BITS: u32 = 24;
const INDEX_MASK: u32 = (1 << INDEX_BITS) - 1;
/// Generations a slot goes through before its numbers repeat.
const GENERATIONS: u32 = 1 << (32 - INDEX_BITS);

/// Most sessions open at once.
pub(crate) const MAX_SESSIONS: usize = 1 << INDEX_BITS;

struct Slot<P> {
    generation: u32,
    /// Boxed: a free slot costs a pointer, not a whole session.
    session: Option<Box<Session<P>>>,
}

/// Sessions by number (see the module docs).
pub(crate) struct SessionTable<P> {
    slots: Vec<Slot<P>>,
    free: Vec<u32>,
}

impl<P> Default for SessionTable<P> {
    fn default() -> Self {
        SessionTable {
            slots: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<P> SessionTable<P> {
    /// Adds `session`; its number, or `None` if [`MAX_SESSIONS`] are open.
    pub(crate) fn insert(&mut self, session: Session<P>) -> Option<u32> {
        let index = match self.free.pop() {
            Some(i) => i,
            None if self.slots.len() < MAX_SESSIONS => {
                self.slots.push(Slot {
                    generation: 0,
                    session: None,
                });
                (self.slots.len() - 1) as u32
            }
            None => return None,
        };
        let slot = &mut self.slots[index as usize];
        slot.session = Some(Box::new(session));
        Some(slot.generation << INDEX_BITS | index)
    }

    fn slot(&self, sid: u32) -> Option<&Slot<P>> {
        self.slots
            .get((sid & INDEX_MASK) as usize)
            .filter(|s| s.generation == sid >> INDEX_BITS)
    }

    /// The open session numbered `sid`.
    pub(crate) fn get(&self, sid: u32) -> Option<&Session<P>> {
        self.slot(sid)?.session.as_deref()
    }

    /// The open session numbered `sid`.
    pub(crate) fn get_mut(&mut self, sid: u32) -> Option<&mut Session<P>> {
        self.slots
            .get_mut((sid & INDEX_MASK) as usize)
            .filter(|s| s.generation == sid >> INDEX_BITS)?
            .session
            .as_deref_mut()
    }

    /// Removes session `sid`; its slot serves the next session, under the
    /// next generation.
    pub(crate) fn take(&mut self, sid: u32) -> Option<Session<P>> {
        let index = sid & INDEX_MASK;
        let slot = self
            .slots
            .get_mut(index as usize)
            .filter(|s| s.generation == sid >> INDEX_BITS)?;
        let session = slot.session.take()?;
        slot.generation = (slot.generation + 1) % GENERATIONS;
        self.free.push(index);
        Some(*session)
    }

    /// Slots in the table, open or free: the open sessions are the
    /// [`at_mut`](Self::at_mut) of `0..capacity()`.
    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// The session open in slot `index` and its number, if one is.
    pub(crate) fn at_mut(&mut self, index: usize) -> Option<(u32, &mut Session<P>)> {
        let s = self.slots.get_mut(index)?;
        let sid = s.generation << INDEX_BITS | index as u32;
        Some((sid, s.session.as_deref_mut()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rpc::session::{Role, SessionState};

    fn session() -> Session<()> {
        Session::new(Role::Client, SessionState::Connected, (), 100)
    }

    #[test]
    fn closed_slots_are_reused_under_a_new_number() {
        let mut t = SessionTable::default();
        let a = t.insert(session()).unwrap();
        let b = t.insert(session()).unwrap();
        assert_ne!(a, b);
        assert!(t.take(a).is_some());
        assert!(t.get(a).is_none() && t.take(a).is_none(), "gone");
        let c = t.insert(session()).unwrap();
        assert_eq!(c & INDEX_MASK, a & INDEX_MASK, "the slot is reused");
        assert_ne!(c, a, "under another number");
        assert!(t.get(a).is_none(), "the old number finds nothing");
        assert!(t.get_mut(c).is_some() && t.get(b).is_some());
        let open: Vec<u32> = (0..t.capacity())
            .filter_map(|i| t.at_mut(i).map(|(sid, _)| sid))
            .collect();
        assert_eq!(open, vec![c, b]);
        for _ in 0..10_000 {
            let s = t.insert(session()).unwrap();
            t.take(s).unwrap();
        }
        assert_eq!(t.capacity(), 3, "churn does not grow the table");
        assert!(t.get(u32::MAX).is_none());
    }
}
