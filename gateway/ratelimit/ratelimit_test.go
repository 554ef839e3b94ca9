package ratelimit

import (
	"fmt"
	"testing"
	"time"
)

type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

func TestAllowAtTheRate(t *testing.T) {
	c := &clock{t: time.Unix(1000, 0)}
	l := New(10, 5, 0, c.now) // 10/s, bursts of 5
	for i := range 5 {
		if ok, _ := l.Allow("alice /pivirt.vm.v1.VMService/ListVMs"); !ok {
			t.Fatalf("call %d of the burst refused", i)
		}
	}
	ok, wait := l.Allow("alice /pivirt.vm.v1.VMService/ListVMs")
	if ok || wait != 100*time.Millisecond {
		t.Fatalf("call past the burst: %v, retry in %s; want refused, retry in 100ms", ok, wait)
	}
	// Other keys have buckets of their own.
	if ok, _ := l.Allow("bob /pivirt.vm.v1.VMService/ListVMs"); !ok {
		t.Error("another principal was limited by alice's calls")
	}
	if ok, _ := l.Allow("alice /pivirt.vm.v1.VMService/GetVM"); !ok {
		t.Error("another route was limited by ListVMs")
	}
	// Over 10 s, 10 per second get through.
	allowed := 0
	for range 1000 {
		c.t = c.t.Add(10 * time.Millisecond)
		if ok, _ := l.Allow("alice /pivirt.vm.v1.VMService/ListVMs"); ok {
			allowed++
		}
	}
	if allowed < 99 || allowed > 101 {
		t.Errorf("%d calls allowed in 10 s at 10/s", allowed)
	}
}

func TestBucketsBounded(t *testing.T) {
	c := &clock{t: time.Unix(1000, 0)}
	l := New(1, 1, 100, c.now)
	for i := range 100 {
		l.Allow(fmt.Sprint("k", i))
	}
	if ok, _ := l.Allow("new"); ok {
		t.Error("a 101st key got a bucket while every bucket is in use")
	}
	c.t = c.t.Add(2 * time.Second) // every bucket refilled: they can go
	if ok, _ := l.Allow("new"); !ok {
		t.Error("a new key refused after the old buckets refilled")
	}
	if n := l.Len(); n != 1 {
		t.Errorf("%d buckets kept, want 1", n)
	}
}
