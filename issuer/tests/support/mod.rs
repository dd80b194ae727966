pub mod android_chain;
