pub(crate) mod android_chain;
pub(crate) mod http;
