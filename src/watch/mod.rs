//! The watch hub: one per replica. It follows the store's watch (every write by any writer
//! on any replica) and streams each watched account's committed events, with the balance
//! after each, to its subscribers; and every write, as a one-line notice, to subscribers of
//! the fleet-wide stream.
//!
//! How it stays exact:
//! - the store's feed names (account, version); for an account someone watches, the hub
//!   reads the new batches once, folds the balance forward and fans the frame out to every
//!   subscriber of that account (`channel`). A feed that fell behind or reconnected is a
//!   gap: every watched account is re-read from where its stream stands;
//! - a subscriber joins under its account's cursor lock: it learns the version the channel
//!   stands at and from then on receives every later frame, so a resume replays up to that
//!   version from the store and goes live after it, with no gap and no duplicate
//!   (`subscriber`);
//! - every subscriber has a bounded buffer; one that falls behind it is told so in a final
//!   event and closed (it resumes with `Last-Event-ID`), so a slow reader never holds
//!   memory or slows the others.
//!
//! The module's files: this one (the hub: limits, joining, leaving, shutdown), `config`
//! (flags), `channel` (one account's cursor and fan-out), `pump` (the feed task) and
//! `subscriber` (one stream's task: replay, live, keep-alive, end).

mod channel;
mod config;
mod pump;
mod subscriber;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

pub use config::{
    CALLER_FULL_RETRY_AFTER_SECS, COUNT_RANGE, DEFAULT_BUFFER, DEFAULT_KEEPALIVE_SECS,
    DEFAULT_MAX_PER_ACCOUNT, DEFAULT_MAX_PER_CALLER, DEFAULT_MAX_REPLAY, DEFAULT_MAX_SUBSCRIBERS,
    KEEPALIVE_RANGE, STALL_KEEPALIVES, WatchConfig,
};

use crate::account::AccountId;
use crate::metrics::Metrics;
use crate::projection::Projection;
use crate::reader::HistoryEntry;
use channel::Channel;

/// Items queued between a subscriber's task and its HTTP body: a few, since the task
/// waits on the body and the real buffer is the hub's ([`WatchConfig::buffer`]).
const OUT_CAPACITY: usize = 8;

/// `stream` label values of `tally_watch_subscribers`.
pub mod stream {
    pub const ACCOUNT: &str = "account";
    pub const ALL: &str = "all";
}

/// Why a subscription cannot start.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WatchError {
    #[error("this replica serves {limit} watch streams already; retry shortly")]
    ReplicaFull { limit: usize },
    #[error("this account has {limit} watch streams already; retry shortly")]
    AccountFull { limit: usize },
    /// The caller holds `--watch-max-per-caller` streams on this replica already: one caller
    /// cannot take every slot from the others.
    #[error(
        "this caller holds {limit} watch streams on this replica already; close one, or retry later"
    )]
    CallerFull { limit: usize },
    #[error("the replica is shutting down")]
    ShuttingDown,
    /// Retryable: the store's watch or a read failed.
    #[error("the store could not be watched: {0}")]
    Store(String),
    /// The resume point is past the account's newest version: nothing there to resume.
    #[error("resume point {from_version} is past the account's newest version {current}")]
    BeyondTip { from_version: u64, current: u64 },
    /// The resume point is further below the stream's version than a replay may cover
    /// (`--watch-max-replay`): that range is the history API's to serve.
    #[error(
        "resuming from version {from_version} would replay {behind} versions (up to the \
         account's version {current}), more than a stream replays ({max}); read that range from \
         /api/accounts/{{id}}/history, then resume from its last version + 1"
    )]
    TooFarBack {
        from_version: u64,
        current: u64,
        behind: u64,
        max: usize,
    },
}

/// Where a stream starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resume {
    /// From now: a snapshot of the balance, then every later event.
    Live,
    /// Every event from this version on (`Last-Event-ID` + 1, or `?fromVersion=`).
    From(u64),
}

/// One event of a batch, with the balance right after it (`None` when the stream cannot
/// be folded: trimmed or unreadable below).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub history: HistoryEntry,
    pub balance_cents: Option<i64>,
}

/// One committed batch of one account, shared by all its subscribers.
#[derive(Debug)]
pub struct AccountFrame {
    pub account: AccountId,
    pub version: u64,
    pub entries: Vec<Entry>,
    /// Its wire form, made once by the first subscriber that sends it.
    pub encoded: OnceLock<Bytes>,
}

/// One write anywhere, for the fleet-wide stream.
#[derive(Debug)]
pub struct WriteFrame {
    pub account: AccountId,
    pub version: u64,
    pub encoded: OnceLock<Bytes>,
}

/// What a stream says next.
#[derive(Clone, Debug)]
pub enum Item {
    /// Where a fresh stream starts: the account's version and balance now.
    Snapshot {
        account: AccountId,
        version: u64,
        balance_cents: Option<i64>,
    },
    /// The resume point was below the trim point; the stream goes on from `first_available`.
    Trimmed {
        from_version: u64,
        first_available: u64,
    },
    Events(Arc<AccountFrame>),
    Write(Arc<WriteFrame>),
    KeepAlive,
    /// The last item: the stream ends, and why.
    End(EndReason),
}

/// Why a stream ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EndReason {
    /// The subscriber's buffer filled: it fell behind. Resume after `last_version`.
    Lagged {
        last_version: Option<u64>,
    },
    Shutdown,
    /// The store's feed lost notifications; the fleet-wide stream cannot re-read "every
    /// account", so it ends and the client reconnects.
    FeedGap,
    /// A store read failed while replaying or following.
    StoreError(String),
    /// An event in the account's stream cannot be decoded.
    Unreadable {
        version: u64,
        reason: String,
    },
}

impl EndReason {
    fn label(&self) -> &'static str {
        match self {
            EndReason::Lagged { .. } => "lagged",
            EndReason::Shutdown => "shutdown",
            EndReason::FeedGap => "feed_gap",
            EndReason::StoreError(_) => "store_error",
            EndReason::Unreadable { .. } => "unreadable",
        }
    }
}

/// How a hub ended a subscriber's feed (set before it drops the sender).
const END_NONE: u8 = 0;
const END_LAGGED: u8 = 1;
const END_SHUTDOWN: u8 = 2;
const END_FEED_GAP: u8 = 3;
const END_UNREADABLE: u8 = 4;
const END_STORE_ERROR: u8 = 5;

/// The hub's side of one subscriber: where its frames go and how the hub ended it.
struct Slot<T> {
    id: u64,
    tx: mpsc::Sender<T>,
    end: Arc<AtomicU8>,
}

/// Pushes `frame` to every slot; a full buffer ends that subscriber as lagged.
fn fan_out<T: Clone>(slots: &mut Vec<Slot<T>>, frame: &T, metrics: &Metrics) {
    slots.retain(|s| match s.tx.try_send(frame.clone()) {
        Ok(()) => true,
        Err(mpsc::error::TrySendError::Full(_)) => {
            s.end.store(END_LAGGED, Ordering::SeqCst);
            metrics.watch_dropped.with_label_values(&["lagged"]).inc();
            false
        }
        Err(mpsc::error::TrySendError::Closed(_)) => false,
    });
}

/// Ends every slot with `end` (by dropping its sender).
fn end_all<T>(slots: &mut Vec<Slot<T>>, end: u8) {
    for s in slots.drain(..) {
        s.end.store(end, Ordering::SeqCst);
    }
}

struct HubState {
    channels: HashMap<AccountId, Member>,
    /// Streams each authenticated caller (`sub`) holds; a caller with none is not listed.
    /// Bounded by `total`.
    per_caller: HashMap<Arc<str>, usize>,
    total: usize,
    closed: bool,
}

/// A channel and how many subscribers hold it (joined or joining).
struct Member {
    channel: Arc<Channel>,
    count: usize,
}

/// The per-replica watch hub.
pub struct Hub {
    projection: Arc<Projection>,
    metrics: Arc<Metrics>,
    limits: WatchConfig,
    /// What the store's answer of no version at all proves ([`NoVersion`]).
    no_version: NoVersion,
    state: Mutex<HubState>,
    global: Mutex<Vec<Slot<Arc<WriteFrame>>>>,
    next_id: AtomicU64,
    /// The feed task and the periodic resync, once started.
    pump: Mutex<Option<[JoinHandle<()>; 2]>>,
    /// Set once the feed is open (`Ok`) or known impossible (`Err`).
    feed_ready: tokio::sync::watch::Sender<Option<Result<(), String>>>,
    shutdown: tokio::sync::watch::Sender<bool>,
    /// Notified accounts read at once (`channel::Channel::notify`).
    reads: Arc<tokio::sync::Semaphore>,
}

/// What a store's details call that finds no version of an account proves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoVersion {
    /// The account has none: every acknowledged create is in the store's answer (the
    /// embedded store, which shares one process's memory with its writers).
    Proven,
    /// Nothing: the store may hide a create that landed (a Celeriant server was found to,
    /// docs/stores.md), and a resume from a version a client saw must stay retryable.
    Unproven,
}

/// Store reads the hub runs at once for notified accounts: the feed hands each commit over
/// without waiting on a read, so one account whose reads lag holds up no other, and what
/// the feed buffers stays small (else it would read each account in turn).
pub const MAX_NOTIFIED_READS: usize = 32;

/// A subscription: the items to send, in order, ending with [`Item::End`] or when the
/// replica stops. Dropping it (the client went away) ends the stream and frees its slot.
pub struct Subscription {
    pub items: mpsc::Receiver<Item>,
}

/// Holds a subscriber's place in the hub's counts; released on drop, whatever ended it.
struct Place {
    hub: Arc<Hub>,
    account: Option<AccountId>,
    caller: Option<Arc<str>>,
    id: u64,
}

impl Drop for Place {
    fn drop(&mut self) {
        self.hub.leave(self.account, self.caller.take(), self.id);
    }
}

impl Hub {
    pub fn new(
        projection: Arc<Projection>,
        metrics: Arc<Metrics>,
        limits: WatchConfig,
        no_version: NoVersion,
    ) -> Arc<Self> {
        Arc::new(Self {
            projection,
            metrics,
            limits,
            no_version,
            state: Mutex::new(HubState {
                channels: HashMap::new(),
                per_caller: HashMap::new(),
                total: 0,
                closed: false,
            }),
            global: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            pump: Mutex::new(None),
            feed_ready: tokio::sync::watch::channel(None).0,
            shutdown: tokio::sync::watch::channel(false).0,
            reads: Arc::new(tokio::sync::Semaphore::new(MAX_NOTIFIED_READS)),
        })
    }

    pub fn limits(&self) -> &WatchConfig {
        &self.limits
    }

    /// Streams open now (both routes).
    pub fn subscribers(&self) -> usize {
        self.state.lock().total
    }

    /// Accounts with at least one stream now.
    pub fn watched_accounts(&self) -> usize {
        self.state.lock().channels.len()
    }

    /// Refuses a resume from `from` whose replay, up to `current` (where the stream goes
    /// live), would pass `--watch-max-replay` versions. Decided before the stream starts, on
    /// the range the replay would really read: past a trim it starts at the trim point, which
    /// only a resume far enough back pays a details call to learn.
    async fn check_replay(
        &self,
        account: AccountId,
        from: u64,
        current: u64,
    ) -> Result<(), WatchError> {
        let max = self.limits.max_replay;
        let span = |start: u64| (current + 1).saturating_sub(start.max(1));
        if span(from) <= max as u64 {
            return Ok(());
        }
        let key = self.projection.identity().key(account);
        let start = match self.projection.log().details(key).await {
            Ok(d) => from.max(d.min_available_version),
            Err(crate::store::StoreError::AggregateNotFound) => from,
            Err(e) => return Err(WatchError::Store(e.brief())),
        };
        if span(start) <= max as u64 {
            return Ok(());
        }
        Err(WatchError::TooFarBack {
            from_version: from,
            current,
            behind: span(start),
            max,
        })
    }

    /// Streams `account`'s events from `resume` on; `caller` is the authenticated caller's
    /// id (`sub`), counted against `--watch-max-per-caller`.
    pub async fn subscribe_account(
        self: &Arc<Self>,
        caller: Option<&str>,
        account: AccountId,
        resume: Resume,
    ) -> Result<Subscription, WatchError> {
        let (place, channel) = self.join(caller, Some(account))?;
        let channel = channel.expect("an account place has a channel");
        self.feed_open().await?;
        let id = place.id;
        let (tx, rx) = mpsc::channel(self.limits.buffer);
        let end = Arc::new(AtomicU8::new(END_NONE));
        let at = channel
            .register(
                self,
                Slot {
                    id,
                    tx,
                    end: end.clone(),
                },
            )
            .await?;
        if let Resume::From(from) = resume
            && from > at.version + 1
        {
            // The channel may trail the store by a notification; ask the store itself.
            let current = self
                .projection
                .store_version(account)
                .await
                .map_err(|e| WatchError::Store(e.brief()))?;
            // No version at all decides only on a store that shows every create. Elsewhere
            // the store may hide a create that landed (docs/stores.md), and the resume
            // would then be from a version a client saw: retryable. On the embedded store
            // no retry could change the answer, so it is final.
            if current == 0 && self.no_version == NoVersion::Unproven {
                return Err(WatchError::Store(
                    "the store shows no version of this account yet; retry".into(),
                ));
            }
            if from > current + 1 {
                return Err(WatchError::BeyondTip {
                    from_version: from,
                    current,
                });
            }
        }
        if let Resume::From(from) = resume {
            self.check_replay(account, from, at.version).await?;
        }
        let (out, items) = mpsc::channel(OUT_CAPACITY);
        let task = subscriber::AccountTask {
            hub: self.clone(),
            account,
            resume,
            at,
            frames: rx,
            end,
            out,
            place,
        };
        tokio::spawn(task.run());
        Ok(Subscription { items })
    }

    /// Streams a notice of every write to any account, from now on; `caller` as for
    /// [`Hub::subscribe_account`].
    pub async fn subscribe_all(
        self: &Arc<Self>,
        caller: Option<&str>,
    ) -> Result<Subscription, WatchError> {
        let (place, _) = self.join(caller, None)?;
        self.feed_open().await?;
        let (tx, rx) = mpsc::channel(self.limits.buffer);
        let end = Arc::new(AtomicU8::new(END_NONE));
        {
            let mut global = self.global.lock();
            if *self.shutdown.borrow() {
                return Err(WatchError::ShuttingDown);
            }
            global.push(Slot {
                id: place.id,
                tx,
                end: end.clone(),
            });
        }
        let (out, items) = mpsc::channel(OUT_CAPACITY);
        let task = subscriber::AllTask {
            hub: self.clone(),
            frames: rx,
            end,
            out,
            place,
        };
        tokio::spawn(task.run());
        Ok(Subscription { items })
    }

    /// Ends every stream with a `shutdown` event and refuses new ones.
    pub fn shutdown(&self) {
        self.shutdown.send_replace(true);
        let channels: Vec<Arc<Channel>> = {
            let mut st = self.state.lock();
            st.closed = true;
            st.channels.values().map(|m| m.channel.clone()).collect()
        };
        for c in channels {
            c.end_all(END_SHUTDOWN);
        }
        end_all(&mut self.global.lock(), END_SHUTDOWN);
        // Readers waiting for a turn end rather than read for streams that are gone.
        self.reads.close();
        for task in self.pump.lock().take().into_iter().flatten() {
            task.abort();
        }
    }

    /// Takes a place under the limits; for an account, in its channel (made if new).
    fn join(
        self: &Arc<Self>,
        caller: Option<&str>,
        account: Option<AccountId>,
    ) -> Result<(Place, Option<Arc<Channel>>), WatchError> {
        let mut st = self.state.lock();
        if st.closed {
            return Err(WatchError::ShuttingDown);
        }
        if st.total >= self.limits.max_subscribers {
            self.metrics
                .watch_refused
                .with_label_values(&["replica"])
                .inc();
            return Err(WatchError::ReplicaFull {
                limit: self.limits.max_subscribers,
            });
        }
        // Before the account's channel is made: a refusal leaves no empty channel behind.
        let held = caller.map_or(0, |c| st.per_caller.get(c).copied().unwrap_or(0));
        if caller.is_some() && held >= self.limits.max_per_caller {
            self.metrics
                .watch_refused
                .with_label_values(&["caller"])
                .inc();
            return Err(WatchError::CallerFull {
                limit: self.limits.max_per_caller,
            });
        }
        let channel = match account {
            None => None,
            Some(account) => {
                let member = st.channels.entry(account).or_insert_with(|| Member {
                    channel: Arc::new(Channel::new(account)),
                    count: 0,
                });
                if member.count >= self.limits.max_per_account {
                    self.metrics
                        .watch_refused
                        .with_label_values(&["account"])
                        .inc();
                    return Err(WatchError::AccountFull {
                        limit: self.limits.max_per_account,
                    });
                }
                member.count += 1;
                Some(member.channel.clone())
            }
        };
        let caller: Option<Arc<str>> = caller.map(Arc::from);
        if let Some(c) = &caller {
            st.per_caller.insert(c.clone(), held + 1);
        }
        st.total += 1;
        drop(st);
        self.gauge(account).inc();
        let place = Place {
            hub: self.clone(),
            account,
            caller,
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
        };
        Ok((place, channel))
    }

    fn leave(&self, account: Option<AccountId>, caller: Option<Arc<str>>, id: u64) {
        let mut st = self.state.lock();
        st.total -= 1;
        if let Some(c) = caller
            && let Some(held) = st.per_caller.get_mut(&c)
        {
            *held -= 1;
            if *held == 0 {
                st.per_caller.remove(&c);
            }
        }
        match account {
            Some(account) => {
                if let Some(member) = st.channels.get_mut(&account) {
                    member.channel.remove(id);
                    member.count -= 1;
                    if member.count == 0 {
                        st.channels.remove(&account);
                    }
                }
            }
            None => self.global.lock().retain(|s| s.id != id),
        }
        drop(st);
        self.gauge(account).dec();
    }

    fn gauge(&self, account: Option<AccountId>) -> prometheus::IntGauge {
        let label = if account.is_some() {
            stream::ACCOUNT
        } else {
            stream::ALL
        };
        self.metrics.watch_subscribers.with_label_values(&[label])
    }

    /// A stream ended because its client stopped reading (`subscriber.rs`).
    fn count_stalled(&self) {
        self.metrics
            .watch_dropped
            .with_label_values(&["stalled"])
            .inc();
    }

    fn count_end(&self, reason: &EndReason) {
        // Lagged subscribers were counted when the hub dropped them.
        if !matches!(reason, EndReason::Lagged { .. }) {
            self.metrics
                .watch_dropped
                .with_label_values(&[reason.label()])
                .inc();
        }
    }

    /// Starts the feed task if it is not running, and waits until the feed is open.
    async fn feed_open(self: &Arc<Self>) -> Result<(), WatchError> {
        {
            let mut pump = self.pump.lock();
            if pump.is_none() && !*self.shutdown.borrow() {
                *pump = Some([
                    tokio::spawn(pump::run(self.clone())),
                    tokio::spawn(pump::resync_periodically(self.clone())),
                ]);
            }
        }
        let mut ready = self.feed_ready.subscribe();
        let mut shutdown = self.shutdown.subscribe();
        loop {
            if let Some(state) = ready.borrow_and_update().clone() {
                return state.map_err(WatchError::Store);
            }
            tokio::select! {
                changed = ready.changed() => if changed.is_err() { return Err(WatchError::ShuttingDown) },
                _ = shutdown.wait_for(|s| *s) => return Err(WatchError::ShuttingDown),
            }
        }
    }

    /// The accounts watched now, for a resync.
    fn channels(&self) -> Vec<Arc<Channel>> {
        self.state
            .lock()
            .channels
            .values()
            .map(|m| m.channel.clone())
            .collect()
    }

    fn channel(&self, account: AccountId) -> Option<Arc<Channel>> {
        self.state
            .lock()
            .channels
            .get(&account)
            .map(|m| m.channel.clone())
    }
}

/// The reason a hub-ended feed carries.
fn end_reason(end: &AtomicU8, last_version: Option<u64>) -> EndReason {
    match end.load(Ordering::SeqCst) {
        END_LAGGED => EndReason::Lagged { last_version },
        END_FEED_GAP => EndReason::FeedGap,
        END_UNREADABLE => EndReason::Unreadable {
            version: last_version.map_or(1, |v| v + 1),
            reason: "an event of the account cannot be decoded".into(),
        },
        END_STORE_ERROR => EndReason::StoreError(format!(
            "the store could not be read for this account for {} s; reconnect with Last-Event-ID to resume",
            channel::READ_FAILURE_LIMIT.as_secs()
        )),
        // A sender dropped without a reason only happens at shutdown.
        _ => EndReason::Shutdown,
    }
}
