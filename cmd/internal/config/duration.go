package config

import (
	"fmt"
	"time"

	"gopkg.in/yaml.v3"
)

// Duration is a time.Duration written in the file as a Go duration string ("30s", "1m30s",
// "500ms"). A bare 0 is accepted; other bare numbers are rejected for lack of a unit.
type Duration time.Duration

// Std returns d as a time.Duration.
func (d Duration) Std() time.Duration { return time.Duration(d) }

// String formats d like time.Duration.
func (d Duration) String() string { return time.Duration(d).String() }

// MarshalYAML writes d as a duration string, so a marshalled Config loads back unchanged.
func (d Duration) MarshalYAML() (any, error) { return d.String(), nil }

// UnmarshalYAML parses a duration string. A null leaves d unchanged.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode {
		return fmt.Errorf("%w: expected a duration such as \"30s\", got %s", ErrType, describe(n))
	}
	switch n.ShortTag() {
	case nullTag:
		return nil
	case strTag, intTag:
	default:
		return fmt.Errorf("%w: expected a duration such as \"30s\", got %s", ErrType, describe(n))
	}
	v, err := time.ParseDuration(n.Value)
	if err != nil {
		return fmt.Errorf("invalid duration %q: %w", n.Value, err)
	}
	*d = Duration(v)
	return nil
}
