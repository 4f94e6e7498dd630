"""The Ascend CAM connectors (CAMP2P, CAMAsync): shared base, operator adapters, evidence."""
