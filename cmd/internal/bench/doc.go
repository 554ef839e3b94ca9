// Package bench holds the replicated-API benchmark of `make bench`: a
// 3-node pivirt-agent cluster against a 3-member etcd cluster started in the
// same process, measured interleaved in the same run and reported as ratios.
// The code is in the _test.go files; see DESIGN.md for what is measured and
// how to read the numbers.
package bench
