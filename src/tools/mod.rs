//! Tools built on the device library, not part of the server: the device simulator, local
//! training of the synthetic demo model, and `confed demo`, which runs a whole task end to end.

pub mod analytics_demo;
pub mod analytics_population;
pub mod demo;
pub mod issuer;
pub mod leftover;
pub mod simulate;
pub mod train;
