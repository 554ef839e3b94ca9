package fsm

import (
	"fmt"
	"unicode"
	"unicode/utf8"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Limits enforced by Apply. They are part of the replicated semantics: a
// change needs every node upgraded before the leader relies on it.
const (
	// MaxIDLength bounds service names, instance IDs, node names, schedule
	// and VM IDs, client IDs, in bytes.
	MaxIDLength = 256
	// MaxConfigKeyLength bounds a config key, in characters.
	MaxConfigKeyLength = 256
	// MaxConfigValueSize bounds a config value, in bytes.
	MaxConfigValueSize = 512 << 10
	// MaxPort is the largest port a service instance may register.
	MaxPort = 65535
	// MaxOutputSize bounds the output of a check result (a heartbeat's),
	// in bytes.
	MaxOutputSize = 1024
)

// invalidf returns an ErrInvalidCommand with a message naming the field.
func invalidf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalidCommand, fmt.Sprintf(format, args...))
}

// checkID validates a required identifier: non-empty, at most MaxIDLength
// bytes, no control characters (NUL would break index keys).
func checkID(field, s string) error {
	if s == "" {
		return invalidf("%s: required", field)
	}
	return checkOptionalID(field, s)
}

// checkOptionalID validates an identifier that may be empty.
func checkOptionalID(field, s string) error {
	if len(s) > MaxIDLength {
		return invalidf("%s: %d bytes, at most %d allowed", field, len(s), MaxIDLength)
	}
	for _, r := range s {
		if unicode.IsControl(r) {
			return invalidf("%s: %q contains a control character", field, s)
		}
	}
	return nil
}

// checkConfigKey validates a config key: 1 to MaxConfigKeyLength
// characters, no whitespace or control characters.
func checkConfigKey(field, key string) error {
	if key == "" {
		return invalidf("%s: required", field)
	}
	if n := utf8.RuneCountInString(key); n > MaxConfigKeyLength {
		return invalidf("%s: %d characters, at most %d allowed", field, n, MaxConfigKeyLength)
	}
	for _, r := range key {
		if unicode.IsSpace(r) || unicode.IsControl(r) {
			return invalidf("%s: %q contains whitespace or a control character", field, key)
		}
	}
	return nil
}

// checkTime validates a timestamp field.
func checkTime(field string, ts *timestamppb.Timestamp, required bool) error {
	if ts == nil {
		if required {
			return invalidf("%s: required", field)
		}
		return nil
	}
	if err := ts.CheckValid(); err != nil {
		return fmt.Errorf("%w: %s: %w", ErrInvalidCommand, field, err)
	}
	return nil
}

// checkDuration validates an optional, non-negative duration field.
func checkDuration(field string, d *durationpb.Duration) error {
	if d == nil {
		return nil
	}
	if err := d.CheckValid(); err != nil {
		return fmt.Errorf("%w: %s: %w", ErrInvalidCommand, field, err)
	}
	if d.AsDuration() < 0 {
		return invalidf("%s: %s is negative", field, d.AsDuration())
	}
	return nil
}

// compareTime orders two timestamps; nil sorts before every time.
func compareTime(a, b *timestamppb.Timestamp) int {
	switch {
	case a == nil && b == nil:
		return 0
	case a == nil:
		return -1
	case b == nil:
		return 1
	}
	if a.GetSeconds() != b.GetSeconds() {
		if a.GetSeconds() < b.GetSeconds() {
			return -1
		}
		return 1
	}
	switch {
	case a.GetNanos() < b.GetNanos():
		return -1
	case a.GetNanos() > b.GetNanos():
		return 1
	}
	return 0
}

// formatTime renders a timestamp for error messages.
func formatTime(ts *timestamppb.Timestamp) string {
	if ts == nil {
		return "none"
	}
	return ts.AsTime().Format("2006-01-02T15:04:05.999999999Z07:00")
}
