//! The store's flags: which event store, where, and as which service.

use clap::ValueEnum;
use uuid::Uuid;

use super::celeriant::CeleriantConfig;
use super::faults::FaultConfig;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    /// The embedded in-process store: for development and tests; keeps nothing across restarts.
    Memory,
    /// A Celeriant cluster: the durable store every replica shares.
    Celeriant,
}

/// Which event store, and the ids the service writes under.
#[derive(Clone, Debug, clap::Args)]
#[command(next_help_heading = "Store")]
pub struct StoreFlags {
    /// Event store backend.
    #[arg(id = "store", long = "store", value_name = "STORE", env = "TALLY_STORE", value_enum, value_parser = crate::flag::named::<StoreKind>(), default_value_t = StoreKind::Memory)]
    pub kind: StoreKind,

    /// The service's Celeriant client id, one for every replica. Default: UUIDv5 of "Tally".
    #[arg(long, env = "TALLY_CLIENT_ID")]
    pub client_id: Option<Uuid>,

    /// The Celeriant org id (a UUID). Default: UUIDv5 of "DemoOrg".
    #[arg(long, env = "TALLY_ORG_ID")]
    pub org_id: Option<Uuid>,

    /// The aggregate type id of accounts (a UUID). Default: UUIDv5 of "Account".
    #[arg(long, env = "TALLY_ACCOUNT_TYPE_ID")]
    pub account_type_id: Option<Uuid>,

    /// Wrap the store in the fault injector (demos and tests), e.g. `lost-ack=0.1,seed=7`.
    // Parsed once, by clap through `FaultConfig`'s `FromStr`: a bad spec is refused at start.
    #[arg(long, env = "TALLY_FAULTS")]
    pub faults: Option<FaultConfig>,

    /// How to reach Celeriant (used with `--store celeriant`).
    #[command(flatten)]
    pub celeriant: CeleriantConfig,
}

impl StoreFlags {
    /// The store as log lines name it: its kind and nodes, never a credential.
    pub fn describe(&self) -> String {
        match self.kind {
            StoreKind::Memory => "the embedded store".into(),
            StoreKind::Celeriant => {
                let c = &self.celeriant;
                let mut nodes = vec![c.address.as_str()];
                nodes.extend(c.seeds.iter().map(String::as_str));
                format!("Celeriant at {}", nodes.join(", "))
            }
        }
    }
}
