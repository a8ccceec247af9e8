//! The copy resync: it keeps the copies below as [`crate::decide::copies`] describes them.
//!
//! Two paths keep the model true. Before a pod is created below, [`Copies::prepare`] makes
//! every copy it references exist with current content. [`Copies::run`] resyncs from the
//! watch caches on every change and every second: it follows upper edits, repairs copies
//! edited or deleted below, deletes copies whose upper object is gone, and deletes copies
//! nobody references once they have been unreferenced for the collection delay (which
//! absorbs rolling updates). Each pass's writes are [`crate::decide::copies::plan`]'s,
//! performed by the executor. Values are never logged.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tensile_common::cache::Cache;

use futures::FutureExt;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use tensile_common::api::ApiError as Error;
use tensile_common::api::{Deleted, code, delete_exact};

use crate::act::LastPass;
use crate::act::ratelimit::WriteLimit;
use crate::decide::copies::Digested;
use crate::decide::copies::Key;
use crate::decide::copies::Model;
use crate::decide::copies::Verdict;
use crate::decide::copies::Write;
use crate::decide::copies::desired;
use crate::decide::copies::judge;
use crate::decide::copies::needs;
use crate::decide::copies::plan;
use crate::metrics::Metrics;
use crate::model::reflected::Reflected;
use crate::model::refs::{Absent, Blocked, Kind, upper_references};
use crate::model::trim::{PodLoad, UpperPod};
use crate::world::ServiceStores;
use crate::world::fetched::{Fetched, Read, Upper};

/// The reflection of ConfigMaps, Secrets, Services and Endpoints for one virtual node.
pub struct Copies {
    /// Reads the content of a fetched kind's upper object when its copy is written.
    pub upper: kube::Client,
    pub lower: kube::Client,
    pub cluster_id: String,
    /// The lower cluster's name, for messages.
    pub cluster_name: String,
    /// The upper ConfigMaps and Secrets the pods bound here reference (metadata only).
    pub upper_config_maps: Fetched<ConfigMap>,
    pub upper_secrets: Fetched<Secret>,
    /// Lower ConfigMaps and Secrets carrying this upper cluster's mark.
    pub lower_config_maps: Cache<ConfigMap>,
    pub lower_secrets: Cache<Secret>,
    /// Upper pods bound to this node.
    pub upper_pods: Cache<UpperPod>,
    /// Lower pods that have not finished (every owner; filtered by mark here).
    pub lower_pods: Cache<PodLoad>,
    pub limit: WriteLimit,
    pub metrics: Arc<Metrics>,
    /// How long a copy stays after its last reference went.
    pub gc_delay: Duration,
    pub unreferenced_since: Mutex<HashMap<Key, Instant>>,
    /// Copies a foreign lower object blocks, and since when.
    pub conflicts: Mutex<HashMap<Key, Instant>>,
    /// The ConfigMap and Secret copies found to digest as written, by version.
    pub digested: Mutex<(Digested, Digested)>,
    /// Services and their Endpoints, when their reflection is enabled.
    pub services: Option<ServiceStores>,
    /// Lower namespaces the pod path judged usable (shared with it).
    pub namespaces: Arc<crate::act::lower_namespaces::LowerNamespaces>,
    /// What the last quiet pass read.
    pub last_pass: LastPass,
    /// Reports conflicts found by the resync on the upper object.
    pub events: crate::act::events::Events,
}

/// How [`Copies::ensure`] left a copy.
#[derive(Debug, PartialEq, Eq)]
enum Ensured {
    /// It exists below with current content.
    Current,
    /// A foreign lower object holds its name.
    Conflict,
    /// The upper object is gone (a fetched kind, deleted since the watch showed it).
    UpperGone,
}

impl Ensured {
    /// `Some(true)` current, `Some(false)` blocked, `None` no upper object.
    fn found(self) -> Option<bool> {
        match self {
            Ensured::Current => Some(true),
            Ensured::Conflict => Some(false),
            Ensured::UpperGone => None,
        }
    }
}

/// One write being performed.
type Pending<'a> = crate::act::Act<'a>;

/// A watch cache read as the whole truth: what it lacks is gone.
fn watched<K: Reflected>(cache: &Cache<K>) -> impl Fn(&str, &str) -> Upper<K> + '_ {
    move |ns, name| match cache.get(&ObjectRef::new(name).within(ns)) {
        Some(k) => Upper::Present(k),
        None => Upper::Gone,
    }
}

/// A cache of followed objects read as what it knows.
fn followed<K: Reflected + Default>(cache: &Fetched<K>) -> impl Fn(&str, &str) -> Upper<K> + '_ {
    move |ns, name| cache.get(ns, name)
}

impl Copies {
    /// Makes the lower copy of `upper` exist with current content. `cached` is what the
    /// lower watch shows under that name (ours only). Of a fetched kind, `upper` is metadata
    /// and the content is read first.
    async fn ensure<K: Reflected>(&self, upper: &K, cached: Option<Arc<K>>) -> Result<Ensured, Error> {
        if !K::FETCHED {
            return self.ensure_whole(upper, cached).await;
        }
        let ns = upper.namespace().unwrap_or_default();
        let name = upper.name_any();
        match Api::<K>::namespaced(self.upper.clone(), &ns)
            .get_opt(&name)
            .await
            .map_err(Error::on("upper", "get", format!("{} {ns}/{name}", K::KIND)))?
        {
            Some(whole) => self.ensure_whole(&whole, cached).await,
            None => Ok(Ensured::UpperGone),
        }
    }

    /// [`Copies::ensure`] of an upper object read whole, its content with it.
    async fn ensure_whole<K: Reflected>(&self, upper: &K, cached: Option<Arc<K>>) -> Result<Ensured, Error> {
        let ns = upper.namespace().unwrap_or_default();
        let name = upper.name_any();
        let what = format!("{} {ns}/{name}", K::KIND);
        let desired = desired(&self.cluster_id, upper);
        let api: Api<K> = Api::namespaced(self.lower.clone(), &ns);
        let actual = match cached {
            Some(a) => Some(a),
            None => {
                self.limit.acquire().await;
                match api.create(&PostParams::default(), &desired).await {
                    Ok(_) => {
                        tracing::info!(kind = %K::KIND, copy = %format!("{ns}/{name}"), "created below");
                        return Ok(Ensured::Current);
                    }
                    Err(e) if code(&e) == Some(409) => api
                        .get_opt(&name)
                        .await
                        .map_err(Error::on("lower", "get", what.clone()))?
                        .map(Arc::new),
                    Err(e) => return Err(Error::on("lower", "create", what)(e)),
                }
            }
        };
        // Gone between our create and get: created once more (a failure is retried), so it
        // is never reported current while it does not exist.
        let Some(actual) = actual else {
            self.limit.acquire().await;
            api.create(&PostParams::default(), &desired)
                .await
                .map_err(Error::on("lower", "create", what))?;
            return Ok(Ensured::Current);
        };
        match judge(&self.cluster_id, &desired, &actual) {
            Verdict::Current => Ok(Ensured::Current),
            Verdict::Conflict => Ok(Ensured::Conflict),
            Verdict::Stale => {
                self.limit.acquire().await;
                let fresh = desired.clone();
                let mut update = desired;
                update.meta_mut().resource_version = actual.resource_version();
                match api.replace(&name, &PostParams::default(), &update).await {
                    Ok(_) => {
                        tracing::info!(kind = %K::KIND, copy = %format!("{ns}/{name}"), "updated below");
                        Ok(Ensured::Current)
                    }
                    // Immutable content (an immutable object, a Secret's type) changes by
                    // replacement: deleted and created again at once, so a pod is never
                    // created below while its source is missing. A create refused because
                    // the old copy is still there fails this pass; the retry creates it.
                    Err(e) if code(&e) == Some(422) => {
                        let deleted = delete_exact(&api, &name, actual.uid(), None)
                            .await
                            .map_err(Error::on("lower", "delete", what.clone()))?;
                        if deleted == Deleted::Accepted {
                            tracing::info!(kind = %K::KIND, copy = %format!("{ns}/{name}"), "replacing a copy whose content is immutable");
                        }
                        self.limit.acquire().await;
                        api.create(&PostParams::default(), &fresh)
                            .await
                            .map_err(Error::on("lower", "create", what))?;
                        Ok(Ensured::Current)
                    }
                    Err(e) => Err(Error::on("lower", "update", what)(e)),
                }
            }
        }
    }

    /// Makes every copy `pod` needs exist below with current content, and returns the
    /// optional references that did not travel (no upper object): [`drop_absent`] takes them
    /// out of the lower pod. `Ok(Err(_))` says why the pod must not be created below yet (a
    /// message for the upper pod).
    pub async fn prepare(&self, pod: &Pod) -> Result<Result<Absent, Blocked>, Error> {
        let ns = pod.namespace().unwrap_or_default();
        let mut seen = BTreeSet::new();
        let mut absent = Absent::new();
        for r in upper_references(pod) {
            // One pass per object; a required reference wins over an optional one.
            if !seen.insert((r.kind, r.name.clone(), r.optional)) {
                continue;
            }
            let outcome = match r.kind {
                // Pods never name these; they follow namespaces, see `needs`.
                Kind::Service | Kind::Endpoints => continue,
                Kind::ConfigMap => {
                    let at = ObjectRef::new(&r.name).within(&ns);
                    let read = self.upper_config_maps.read(&ns, &r.name).await;
                    match read.map_err(Error::on("upper", "get", format!("{} {ns}/{}", r.kind, r.name)))? {
                        Some(Read::Known(upper)) => self
                            .ensure(&*upper, self.lower_config_maps.get(&at))
                            .await?
                            .found(),
                        Some(Read::Whole(upper)) => self
                            .ensure_whole(&upper, self.lower_config_maps.get(&at))
                            .await?
                            .found(),
                        None => None,
                    }
                }
                Kind::Secret => {
                    let at = ObjectRef::new(&r.name).within(&ns);
                    let read = self.upper_secrets.read(&ns, &r.name).await;
                    match read.map_err(Error::on("upper", "get", format!("{} {ns}/{}", r.kind, r.name)))? {
                        Some(Read::Known(upper)) => {
                            self.ensure(&*upper, self.lower_secrets.get(&at)).await?.found()
                        }
                        Some(Read::Whole(upper)) => self
                            .ensure_whole(&upper, self.lower_secrets.get(&at))
                            .await?
                            .found(),
                        None => None,
                    }
                }
            };
            match outcome {
                Some(true) => {}
                Some(false) => {
                    return Ok(Err(Blocked::Conflict(format!(
                        "lower cluster {} already has a {} {ns}/{} ({}) not created by this upper cluster; it is left untouched and the pod is not started below",
                        self.cluster_name, r.kind, r.name, r.via
                    ))));
                }
                None if r.optional => {
                    absent.insert((r.kind, r.name.clone()));
                }
                None => {
                    let token = if r.kind == Kind::Secret {
                        " (service-account token Secrets are never copied)"
                    } else {
                        ""
                    };
                    return Ok(Err(Blocked::Missing(format!(
                        "{} {ns}/{} ({}) does not exist in the upper cluster{token}",
                        r.kind, r.name, r.via
                    ))));
                }
            }
        }
        Ok(Ok(absent))
    }

    /// The change counts of what a pass reads.
    fn inputs(&self) -> Vec<u64> {
        let mut inputs = vec![
            self.upper_pods.changes(),
            self.lower_pods.changes(),
            self.upper_config_maps.changes(),
            self.upper_secrets.changes(),
            self.lower_config_maps.changes(),
            self.lower_secrets.changes(),
        ];
        if let Some(s) = &self.services {
            inputs.extend([
                s.upper_services.changes(),
                s.upper_endpoints.changes(),
                s.lower_services.changes(),
                s.lower_endpoints.changes(),
            ]);
        }
        inputs
    }

    /// One resync pass: the plan of every kind, then its writes, 16 at a time. Skipped while
    /// nothing it reads changed since a pass that planned nothing ([`LastPass`]).
    pub async fn sync(&self) -> crate::act::Pass {
        let began = Instant::now();
        let inputs = self.inputs();
        if self.last_pass.unchanged(&inputs, began) {
            return crate::act::Pass::default();
        }
        let upper_services = self.services.as_ref().map(|s| s.upper_services.state());
        let (needed, used_below) = needs(
            &self.cluster_id,
            &self.upper_pods.state(),
            &self.lower_pods.state(),
            upper_services
                .as_deref()
                .zip(self.services.as_ref().map(|s| s.include_system)),
            |ns| self.namespaces.known(ns),
        );
        let mut work: Vec<Pending<'_>> = Vec::new();
        {
            let now = Instant::now();
            let mut since = match self.unreferenced_since.lock() {
                Ok(s) => s,
                Err(poisoned) => poisoned.into_inner(),
            };
            let mut conflicts = match self.conflicts.lock() {
                Ok(c) => c,
                Err(poisoned) => poisoned.into_inner(),
            };
            // Conflicts are retried every 30 s, not on every pass.
            conflicts.retain(|_, at| now.duration_since(*at) < Duration::from_secs(30));
            let model = Model {
                cluster_id: &self.cluster_id,
                needed: &needed,
                used_below: &used_below,
                now,
                conflicts: &conflicts,
                gc_delay: self.gc_delay,
            };
            let mut digested = match self.digested.lock() {
                Ok(d) => d,
                Err(poisoned) => poisoned.into_inner(),
            };
            let (config_maps, secrets) = &mut *digested;
            self.schedule(
                &model,
                followed(&self.upper_config_maps),
                &self.lower_config_maps,
                false,
                (&mut since, config_maps),
                &mut work,
            );
            self.schedule(
                &model,
                followed(&self.upper_secrets),
                &self.lower_secrets,
                false,
                (&mut since, secrets),
                &mut work,
            );
            if let Some(s) = &self.services {
                // Copied whole, never digested.
                let mut unused = Digested::default();
                self.schedule(
                    &model,
                    watched(&s.upper_services),
                    &s.lower_services,
                    true,
                    (&mut since, &mut unused),
                    &mut work,
                );
                self.schedule(
                    &model,
                    watched(&s.upper_endpoints),
                    &s.lower_endpoints,
                    true,
                    (&mut since, &mut unused),
                    &mut work,
                );
            }
            // Quiet: no write, and no copy waiting out its collection delay or a conflict
            // its retry.
            let quiet = work.is_empty() && since.is_empty() && conflicts.is_empty();
            self.last_pass.record(inputs, quiet, now);
        }
        let mut copies = self.lower_config_maps.len() + self.lower_secrets.len();
        if let Some(s) = &self.services {
            copies += s.lower_services.len() + s.lower_endpoints.len();
        }
        self.metrics.copies.set(copies.try_into().unwrap_or(i64::MAX));
        let planned_in = began.elapsed();
        // A copy's write never teaches the next pass anything.
        crate::act::act(work, 16, "copy", &self.metrics).await;
        crate::act::Pass {
            again: false,
            planned_in,
        }
    }

    /// Plans the copies of kind `K` and queues their writes.
    fn schedule<'a, K: Reflected>(
        &'a self,
        model: &Model<'_>,
        upper: impl Fn(&str, &str) -> Upper<K>,
        lower: &Cache<K>,
        create_needed: bool,
        (since, digested): (&mut HashMap<Key, Instant>, &mut Digested),
        work: &mut Vec<Pending<'a>>,
    ) {
        let writes = plan(model, upper, &lower.state(), create_needed, since, digested);
        // A copy's write never teaches the next pass anything: `false`.
        work.extend(
            writes
                .into_iter()
                .map(|w| self.perform(w).map(|done| done.map(|()| false)).boxed()),
        );
    }

    async fn perform<K: Reflected>(&self, write: Write<K>) -> Result<(), Error> {
        match write {
            Write::Create { upper } => self.ensure_quietly(upper, None).await,
            Write::Update { upper, copy } => self.ensure_quietly(upper, Some(copy)).await,
            Write::Delete {
                namespace,
                name,
                uid,
                why,
            } => {
                self.limit.acquire().await;
                let api = Api::<K>::namespaced(self.lower.clone(), &namespace);
                let deleted = delete_exact(&api, &name, uid, None).await.map_err(Error::on(
                    "lower",
                    "delete",
                    format!("{} {namespace}/{name}", K::KIND),
                ))?;
                if deleted == Deleted::Accepted {
                    tracing::info!(kind = %K::KIND, copy = %format!("{namespace}/{name}"), "deleted below: {why}");
                }
                Ok(())
            }
        }
    }

    /// [`Copies::ensure`] for the resync: a conflict is remembered (retried in 30 s) and
    /// reported once as a Warning event on the upper object.
    async fn ensure_quietly<K: Reflected>(&self, upper: Arc<K>, cached: Option<Arc<K>>) -> Result<(), Error> {
        if self.ensure(&*upper, cached).await? == Ensured::Conflict {
            let key = (K::KIND, upper.namespace().unwrap_or_default(), upper.name_any());
            let first = match self.conflicts.lock() {
                Ok(mut c) => c.insert(key.clone(), Instant::now()).is_none(),
                Err(_) => false,
            };
            let message = format!(
                "lower cluster {} already has a {} {}/{} not created by this upper cluster; it is left untouched",
                self.cluster_name, key.0, key.1, key.2
            );
            tracing::warn!("{message}");
            if first {
                self.events.publish(
                    upper.object_ref(&()),
                    EventType::Warning,
                    "LowerCopyConflict",
                    &message,
                );
            }
        }
        Ok(())
    }
}
