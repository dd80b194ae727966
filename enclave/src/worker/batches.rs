//! A job's contribution reads in the store's batches (`JobStore::fetch_batch`: one request for
//! several contributions over the worker API), for the first read (`gather`) and the open step
//! (`open`) alike, with every item the store serves paired with the input it was read for.

use confed_worker_api::reads::READ_AHEAD;
use confed_worker_api::store::{JobStore, StoreError};
use futures_util::stream::BoxStream;
use futures_util::{Stream, StreamExt};

use super::Worker;

/// Contributions read, each with what it was read for (`one_per`).
pub(super) type Paired<'a, T> = BoxStream<'a, Result<(T, Option<Vec<u8>>), StoreError>>;

impl<S: JobStore + 'static> Worker<S> {
    /// The contributions of `items` (each a tag and a blob key), read in the store's batches
    /// with `batches_in_flight` of them at once, as they arrive: one item per tag (`one_per`),
    /// or an error. `short` names the error of a tag the store served nothing for.
    pub(super) fn read_in_batches<T: Send + 'static>(
        &self,
        items: Vec<(T, String)>,
        short: fn(&T) -> StoreError,
    ) -> impl Stream<Item = Result<(T, Option<Vec<u8>>), StoreError>> + Send + '_ {
        let size = self.store.batch_reads();
        futures_util::stream::iter(in_batches(items, size))
            .map(move |batch| {
                let (tags, keys): (Vec<T>, Vec<String>) = batch.into_iter().unzip();
                one_per(tags, self.store.fetch_batch(keys, &self.buffers), short)
            })
            .flatten_unordered(batches_in_flight(size))
    }
}

/// `items` in batches of `size` (the last one shorter), as the store reads them
/// (`JobStore::batch_reads`).
fn in_batches<T>(items: Vec<T>, size: usize) -> impl Iterator<Item = Vec<T>> {
    let mut items = items.into_iter();
    std::iter::from_fn(move || {
        let next: Vec<T> = items.by_ref().take(size.max(1)).collect();
        (!next.is_empty()).then_some(next)
    })
}

/// The batches in flight at once for batches of `size`: as many as keep `READ_AHEAD`
/// contributions coming, at least two (one being answered while the next is asked for).
fn batches_in_flight(size: usize) -> usize {
    (READ_AHEAD / size.max(1)).max(2)
}

/// What `JobStore::fetch_batch` served, paired in order with the tags it was named for. The
/// first error ends it: one the store served, `short(tag)` for the first tag the store served
/// nothing for, or one for an item beyond the last tag (the batch is read to its end, so a
/// worker API answer is checked whole and its connection kept). The job then fails: no
/// contribution it names is ever left out silently.
fn one_per<'a, T: Send + 'a>(
    tags: Vec<T>,
    fetched: BoxStream<'a, Result<Option<Vec<u8>>, StoreError>>,
    short: fn(&T) -> StoreError,
) -> Paired<'a, T> {
    futures_util::stream::unfold(
        Some((tags.into_iter(), fetched.fuse())),
        move |state| async move {
            let (mut tags, mut fetched) = state?;
            let Some(tag) = tags.next() else {
                return match fetched.next().await {
                    None => None,
                    Some(Err(error)) => Some((Err(error), None)),
                    Some(Ok(_)) => Some((
                        Err(StoreError::Backend(
                            "the store served more contributions than a batch of reads named"
                                .into(),
                        )),
                        None,
                    )),
                };
            };
            match fetched.next().await {
                Some(Ok(stored)) => Some((Ok((tag, stored)), Some((tags, fetched)))),
                Some(Err(error)) => Some((Err(error), None)),
                None => Some((Err(short(&tag)), None)),
            }
        },
    )
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    type Served = Result<Option<Vec<u8>>, StoreError>;

    async fn paired(
        tags: usize,
        served: Vec<Served>,
    ) -> Vec<Result<(usize, Option<Vec<u8>>), String>> {
        let fetched = futures_util::stream::iter(served).boxed();
        one_per((0..tags).collect(), fetched, |tag| {
            StoreError::Backend(format!("short at {tag}"))
        })
        .map(|item| item.map_err(|e| e.to_string()))
        .collect()
        .await
    }

    fn served(count: usize) -> Vec<Served> {
        (0..count).map(|i| Ok(Some(vec![i as u8]))).collect()
    }

    #[tokio::test]
    async fn a_batch_served_whole_pairs_each_item_with_its_tag() {
        let items = paired(3, served(3)).await;
        let tags: Vec<usize> = items.iter().map(|item| item.as_ref().unwrap().0).collect();
        assert_eq!(tags, [0, 1, 2]);
        assert_eq!(items[2].as_ref().unwrap().1, Some(vec![2]));
    }

    #[tokio::test]
    async fn a_batch_served_short_ends_in_the_first_missing_tags_error() {
        let items = paired(3, served(1)).await;
        assert_eq!(items.len(), 2);
        assert!(items[0].is_ok());
        assert_eq!(items[1].as_ref().unwrap_err(), "store: short at 1");
    }

    #[tokio::test]
    async fn a_batch_served_long_ends_in_an_error() {
        let items = paired(2, served(3)).await;
        assert_eq!(items.len(), 3);
        assert!(items[..2].iter().all(Result::is_ok));
        assert!(
            items[2]
                .as_ref()
                .unwrap_err()
                .contains("more contributions")
        );
    }

    #[tokio::test]
    async fn a_store_error_mid_batch_is_the_last_item_not_a_missing_contribution() {
        let mut served = served(3);
        served[1] = Err(StoreError::Backend("the bucket is down".into()));
        let items = paired(3, served).await;
        assert_eq!(items.len(), 2);
        assert_eq!(items[1].as_ref().unwrap_err(), "store: the bucket is down");
    }

    #[test]
    fn batches_cover_every_item_once_in_order() {
        let batches: Vec<Vec<u32>> = in_batches((0..7).collect(), 3).collect();
        assert_eq!(batches, [vec![0, 1, 2], vec![3, 4, 5], vec![6]]);
        assert_eq!(in_batches(vec![1], 0).count(), 1);
    }

    #[test]
    fn single_reads_keep_read_ahead_in_flight_and_batches_two() {
        assert_eq!(batches_in_flight(1), READ_AHEAD);
        assert_eq!(batches_in_flight(32), 2);
    }
}
