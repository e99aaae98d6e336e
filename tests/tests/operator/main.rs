//! Tests of the operator's parts that talk to real systems: the lag it reads and the topics it
//! creates (against the broker `make test` starts, and librdkafka's mock cluster for commit
//! metadata), and the CRD (against a real Kubernetes API server, when one can be built here).

mod crd;
mod image_contract;
mod lag;
mod process;
mod topics;
