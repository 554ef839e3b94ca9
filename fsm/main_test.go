package fsm

import (
	"fmt"
	"os"
	"testing"
)

// TestMain makes every test of the package an atomicity check: an apply
// function that fails after writing panics instead of being rolled back
// quietly. Tests of the rollback itself swap the hook.
func TestMain(m *testing.M) {
	writeThenFail = func(index uint64, err error) {
		panic(fmt.Sprintf("entry %d failed after writing (an apply function must check everything before its first write): %v", index, err))
	}
	os.Exit(m.Run())
}
