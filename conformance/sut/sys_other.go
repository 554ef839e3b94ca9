//go:build !linux

package main

import "os/exec"

// setPdeathsig: only Linux kills children with their parent.
func setPdeathsig(*exec.Cmd) {}

// reserve: ports are reserved across processes on Linux only.
func reserve(int) bool { return true }
