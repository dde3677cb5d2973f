//! CNI conf/bin installer (stub).
