pub mod android_chain;
pub mod http;
