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

// TestBudget: tokens taken and not given back are spent; given back, they
// are not; concurrent takers each hold one, so they cannot overdraw it.
func TestBudget(t *testing.T) {
	now := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	b := NewBudget(5, 3, 0, func() time.Time { return now })
	for range 10 {
		if ok, _ := b.Take("good"); !ok {
			t.Fatal("a budget whose tokens are given back ran out")
		}
		b.GiveBack("good")
	}
	taken := 0
	for range 10 { // ten at once, none given back yet
		if ok, _ := b.Take("bad"); ok {
			taken++
		}
	}
	if taken != 3 {
		t.Fatalf("%d taken at once, want the burst of 3", taken)
	}
	ok, wait := b.Take("bad")
	if ok || wait != 200*time.Millisecond {
		t.Fatalf("Take with none left = %v, %s; want false, 200ms", ok, wait)
	}
	now = now.Add(200 * time.Millisecond)
	if ok, _ := b.Take("bad"); !ok {
		t.Fatal("no token after the refill time")
	}
}
